"""Tensor parallelism over torch.distributed: each rank holds 1/N of every layer (`shard`),
the ranks are started or joined by `launch`, and exchange tensors through `comm`."""
