"""Bad input to the attention streamed on its own (app/bench/sda.py) gets a ValueError that
says what is expected."""
import pytest
import torch

from models.sda import segment_means
from app.bench.sda import streaming_sda


@pytest.mark.parametrize("args,kw,match", [
    (("flash", 8), {}, "valid: regular, continual, nystrom, continual_nystrom"),
    (("regular", 0), {}, "window must be"),
    (("nystrom", 8), {}, "needs num_landmarks"),
    (("nystrom", 8), {"num_landmarks": 0}, "1 <= m <= window"),
    (("nystrom", 8), {"num_landmarks": 9}, "1 <= m <= window"),
    (("nystrom", 8), {"num_landmarks": 2, "landmark_mode": "continual"}, "valid: \\('segment', 'fixed'\\)"),
    (("continual_nystrom", 8), {"num_landmarks": 2, "landmark_mode": "kmeans"}, "valid: \\('continual', 'fixed'\\)"),
    (("continual_nystrom", 8), {"num_landmarks": 2, "landmark_mode": "fixed"}, "needs fixed_landmarks"),
    (("regular", 8), {"num_landmarks": 2}, "takes no landmarks"),
    (("continual_nystrom", 8), {"fixed_landmarks": (torch.zeros(2, 4), torch.zeros(3, 4)),
                                "landmark_mode": "fixed"}, "fixed landmarks must be"),
])
def test_bad_construction(args, kw, match):
    with pytest.raises(ValueError, match=match):
        streaming_sda(*args, **kw)


def test_step_before_reset_is_a_clear_error():
    s = streaming_sda("continual", 4)
    with pytest.raises(RuntimeError, match="before reset"):
        s.step(torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(1, 8))


def test_bad_step_inputs_name_the_expected_shape():
    s = streaming_sda("continual_nystrom", 4, num_landmarks=2)
    s.reset(2)
    with pytest.raises(ValueError, match=r"\(2, 8\)"):
        s.step(torch.zeros(3, 8), torch.zeros(3, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="shape"):
        s.step(torch.zeros(2, 8), torch.zeros(2, 1, 8), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="floating point"):
        s.step(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8), torch.zeros(2, 8))
    s.step(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, 8))         # the stream starts float32
    with pytest.raises(ValueError, match="dtype|float64"):
        s.step(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 8, dtype=torch.float64),
               torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(2, 8\)"):
        s.step(torch.zeros(2, 9), torch.zeros(2, 9), torch.zeros(2, 9))
    with pytest.raises(ValueError, match="batch_size"):
        s.reset(0)


def test_segment_means_sizes_follow_the_paper():
    x = torch.arange(7.0).reshape(1, 7, 1)
    got = segment_means(x, 3)[0, :, 0]          # segments [0,1,2] [3,4] [5,6]
    torch.testing.assert_close(got, torch.tensor([1.0, 3.5, 5.5]))
    with pytest.raises(ValueError, match="1 <= m <= window"):
        segment_means(x, 8)


@pytest.mark.parametrize("variant", ["nystrom", "continual_nystrom"])
def test_fixed_landmarks_of_another_head_dimension_are_refused(variant):
    s = streaming_sda(variant, 8, landmark_mode="fixed",
                      fixed_landmarks=(torch.zeros(2, 4), torch.zeros(2, 4)))
    s.reset(1)
    with pytest.raises(ValueError, match="fixed landmarks have d=4, inputs have d=6"):
        s.step(torch.zeros(1, 6), torch.zeros(1, 6), torch.zeros(1, 6))
