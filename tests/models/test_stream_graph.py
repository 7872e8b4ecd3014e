"""The exported graphs' warm-up with fewer landmarks than m (models/stream/graph.present_pinv):
absent landmarks padded as the identity leave the present ones' pseudo-inverse as it is."""
import torch

from models.sda.reference import landmark_pinv
from models.stream.graph import present_pinv


def test_absent_landmarks_leave_the_present_ones_pseudo_inverse_and_exact_zeros_off_it():
    g = torch.Generator().manual_seed(0)
    H, m, dh = 4, 5, 12
    for c in range(1, m + 1):
        ql, kl = (torch.randn(H, m, dh, generator=g) * 3 for _ in range(2))
        ql[:, c:], kl[:, c:] = 0, 0                         # as the warm-up pads them
        z = present_pinv(ql, kl, torch.arange(m) < c, 6)
        want = landmark_pinv(ql[:, :c], kl[:, :c], 6)
        # the same float64 iteration on the same block, rounded to float32: the block may
        # differ only by the summation order of the padded products (an ulp of float64)
        torch.testing.assert_close(z[:, :c, :c], want, rtol=0, atol=4 * torch.finfo(torch.float32).eps * want.abs().max().item())
        assert (z[:, :c, c:] == 0).all() and (z[:, c:, :c] == 0).all()
        if c == m:                                          # all present: landmark_pinv itself
            assert torch.equal(z, want)
