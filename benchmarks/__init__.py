"""Side-by-side benchmarks of nbresume against torch.save, torch.distributed.checkpoint,
Lightning and Accelerate: ``python -m benchmarks --quick`` (see ``benchmarks/README.md``)."""
