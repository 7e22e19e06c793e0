"""The node's shared prefix cache and the engine connectors' completion events.

- `prefix`: `PrefixCache`, its namespaces of host blocks and their pins.
- `index`: `CacheIndex`, one namespace's keys, slots and LRU order.
- `worker_events`: completion events per worker, taken by the connectors.
"""
