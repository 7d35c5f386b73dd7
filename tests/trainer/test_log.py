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


def test_responses_are_logged_as_text_not_printed(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path))
    _log(writer, {"reward/mean": 0.5, "samples/responses": "reward 1, stop: '42'"}, step=3)
    writer.close()
    assert "samples/responses" not in capsys.readouterr().err
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("samples/responses/text_summary")
    assert text.step == 3 and b"reward 1, stop: '42'" in text.tensor_proto.string_val[0]


def test_plan_names_model_task_steps_and_where_logs_go():
    from megatron_fp8rl.config.loader import load_config
    from megatron_fp8rl.trainer.config import RunConfig
    from megatron_fp8rl.trainer.start import plan_lines

    cfg = load_config(RunConfig, None, ["model.hf_path=/models/smol", "run_dir=/runs/x", "train.steps=7",
                                        "data.prompts_per_step=4", "rollout.n_samples=6",
                                        "data.arithmetic_ops=[mul,mul2]", "train.eval_every=5"])
    plan = "\n".join(plan_lines(cfg, train_size=1000, eval_size=300))
    for expected in ("/models/smol", "built-in arithmetic (mul, mul2): 1000 training prompts, 300 held out",
                     "7 x 4 prompts x 6 samples", "every 5 steps and at the end", "/runs/x/tb",
                     "/runs/x/summary.json", "/runs/x/hf"):
        assert expected in plan


def test_progress_bar_shows_each_phase_time():
    from megatron_fp8rl.trainer.loop import bar_text

    text = bar_text({"reward/mean": 0.25, "time/rollout_s": 12.4, "time/recompute_s": 0.0,
                     "time/train_s": 40.2, "time/sync_s": 5.1, "eval/accuracy": 0.18})
    assert text == "reward 0.25, rollout 12s, train 40s, sync 5s, eval acc 0.180"
