"""A step's reward failures reach the console and tensorboard with their first error text (before:
only the counts, as scalars)."""
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from megatron_fp8rl.trainer.loop import _log


def test_first_reward_error_is_printed_and_logged_as_text(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path))
    _log(writer, {"reward/mean": 0.5, "reward/errors": 3.0, "reward/timeouts": 1.0, "reward/invalid": 0.0,
                  "reward/first_error": "reward raised KeyError: 'x'"}, step=7)
    writer.close()
    assert "step 7: reward/first_error: reward raised KeyError: 'x' (errors 3, timeouts 1)" in capsys.readouterr().err
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("reward/first_error/text_summary")
    assert text.step == 7 and b"reward raised KeyError" in text.tensor_proto.string_val[0]
    assert [e.value for e in events.Scalars("reward/errors")] == [3.0]
