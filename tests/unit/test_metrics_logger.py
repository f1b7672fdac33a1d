"""The metrics logger writes metrics.jsonl, TensorBoard scalars and wandb calls."""



from tests.tiny_runs import read_metrics


def test_metrics_logger_writes_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch):
    import sys
    import types

    from rlhf.utils.logging import MetricsLogger, WandbSettings

    calls = []
    fake = types.SimpleNamespace(
        login=lambda key: calls.append(("login", key)),
        init=lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(
            log=lambda m, step: calls.append(("log", step, m)), finish=lambda: calls.append(("finish",))))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(str(tmp_path), str(tmp_path / "tb"), total_steps=2, enabled=True,
                           wandb=WandbSettings("k3y", "proj", "grp", "run1", {"seed": 1}))
    logger.log(1, {"reward_mean": 0.5, "time/step": 1.25})
    logger.close()
    assert read_metrics(tmp_path) == [{"step": 1, "reward_mean": 0.5, "time/step": 1.25}]
    assert calls[0] == ("login", "k3y")
    assert calls[1] == ("init", {"entity": None, "project": "proj", "group": "grp", "name": "run1",
                                 "config": {"seed": 1}})
    assert calls[2] == ("log", 1, {"reward_mean": 0.5, "time/step": 1.25})
    assert calls[3] == ("finish",)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Scalars("reward_mean")[0].value == 0.5
