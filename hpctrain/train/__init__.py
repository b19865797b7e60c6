"""Training: start-up, the step runner (a checked schedule per stage), the loop, metrics and the trace.

    from hpctrain.train import Trainer
    trainer = Trainer(cfg, mesh=mesh)      # collective over mesh.world
    trainer.run()

Modules: ``startup`` (agreements, buffers, the start scattered to the stages),
``step`` (one step and one evaluation pass through the executor), ``loop`` (the
Trainer), ``metrics`` (JSONL lines), ``trace`` (Chrome/Perfetto trace), ``stop`` (stop signals).
"""

__all__ = ["Trainer"]


def __getattr__(name):  # the Trainer on first use: train.stop is imported before numpy at the command line's entry
    if name == "Trainer":
        from .loop import Trainer

        return Trainer
    raise AttributeError(f"module 'hpctrain.train' has no attribute {name!r}")
