"""The padded torch linear of float matrices where the packed kernels do not run (`DenseWeight`):
per-row results independent of the batch."""

import torch
import torch.nn.functional as F

from minerva.kernels.weights import linear


def test_rows_do_not_depend_on_batch_size():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g)
    x = torch.randn(64, 576, generator=g)
    full = linear(x, w)
    torch.testing.assert_close(full, F.linear(x, w))  # the reference, within rounding
    for rows in range(1, 40):
        assert torch.equal(linear(x[:rows], w), full[:rows]), rows
        assert torch.equal(linear(x[rows - 1:rows + 3], w)[0], full[rows - 1]), rows
