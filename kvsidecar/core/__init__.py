"""The reference's pure semantics, no I/O: what every other room builds on.

- `layout`: buffer descriptors (kv-first, blocks-first, split K/V, MLA; NHD/HND), views of mapped
  bytes, TP head slices.
- `fixes`: the receive-side layout fixes (permute, block-size remap, both), `fix_received`.
- `topology`: `EngineTransferInfo`, `TransferTopology`: which remote ranks a rank reads.
- `aggregator`: `CompletionAggregator`, the per-engine completion semantics.
- `mover`: a move validated and planned as coalesced runs of blocks.
- `copier`: a planned move copied, layers stacked where they share one region.
- `integrity`: block checksums for end-to-end verification of moves.

May import numpy, torch and `kvsidecar.wire` types; nothing else of the package.
"""
