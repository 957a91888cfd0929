"""``python -m trajstore.integrations.verl.main_ppo <verl's hydra overrides>``: verl's
``main_ppo`` with capture, the one switch for a verl user.

Why a module of its own and not a patch to verl: verl builds its trainer inside a Ray actor
(its ``TaskRunner``), so the capture must be in place in that process. This entry point
composes the config exactly as ``verl.trainer.main_ppo`` does (same Hydra config, same
overrides, same validation), then runs verl's own ``run_ppo`` with a task runner that,
inside the Ray actor, swaps the trainer class for its capturing subclass
(`trajstore.integrations.verl.trainer.capturing`) before calling verl's own ``run``. The
``TRAJSTORE_*`` variables go to every Ray worker through the runtime environment.

    TRAJSTORE_CAPTURE=1 TRAJSTORE_CAPTURE_STORE=runs.store TRAJSTORE_RUN=grpo-7b \\
        python -m trajstore.integrations.verl.main_ppo algorithm.adv_estimator=grpo ...

With capture off it is verl's ``main_ppo`` unchanged.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["capture_env", "main", "run"]


def capture_env(environ: Any = None) -> dict[str, str]:
    """The ``TRAJSTORE_*`` / ``RELAX_REPLAY_CAPTURE*`` variables every Ray worker needs."""
    environ = os.environ if environ is None else environ
    prefixes = ("TRAJSTORE_", "RELAX_REPLAY_CAPTURE")
    return {k: v for k, v in environ.items() if k.startswith(prefixes)}


def _install_in_runner() -> None:
    """Inside verl's task runner (a Ray actor): make its trainer classes capturing."""
    from trajstore.integrations.verl.trainer import capturing

    try:
        import verl.trainer.ppo.v1 as v1

        original = v1.get_trainer_cls
        if not getattr(original, "_trajstore", False):

            def get_trainer_cls(name: str) -> type:
                return capturing(original(name))

            get_trainer_cls._trajstore = True  # type: ignore[attr-defined]
            v1.get_trainer_cls = get_trainer_cls
    except ImportError:  # the v1 trainer needs TransferQueue; the legacy one does not
        pass
    import verl.trainer.main_ppo_v0 as v0

    v0.RayPPOTrainer = capturing(v0.RayPPOTrainer)


def _runner(legacy: bool) -> Any:
    """verl's task runner class (legacy or v1) whose ``run`` installs capture first."""
    import ray

    if legacy:
        from verl.trainer.main_ppo_v0 import TaskRunner as remote_cls
    else:
        from verl.trainer.main_ppo import TaskRunnerV1 as remote_cls
    base = remote_cls.__ray_metadata__.modified_class

    class CapturingTaskRunner(base):  # type: ignore[misc, valid-type]
        def run(self, config: Any) -> Any:
            _install_in_runner()
            return super().run(config)

    CapturingTaskRunner.__name__ = f"Capturing{base.__name__}"
    return ray.remote(CapturingTaskRunner)


def run(config: Any) -> None:
    """verl's ``main_ppo.main`` body on a composed ``config``, with capture when it is on."""
    from omegaconf import open_dict
    from verl.trainer import main_ppo as verl_main
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    from trajstore.integrations.verl import capture_manager

    auto_set_device(config)
    validate_config(
        config=config,
        use_reference_policy=need_reference_policy(config),
        use_critic=need_critic(config),
    )
    legacy = not config.trainer.use_v1
    if not capture_manager().enabled:
        runner = verl_main.TaskRunnerV1 if not legacy else None
        if runner is None:
            from verl.trainer.main_ppo_v0 import TaskRunner as runner
        verl_main.run_ppo(config, task_runner_class=runner)
        return
    with open_dict(config):
        ray_init = config.ray_kwargs.setdefault("ray_init", {})
        runtime_env = ray_init.setdefault("runtime_env", {})
        env_vars = runtime_env.setdefault("env_vars", {})
        for name, value in capture_env().items():
            env_vars[name] = value
    verl_main.run_ppo(config, task_runner_class=_runner(legacy))


def main(argv: list[str] | None = None) -> None:
    """Hydra's entry point on verl's own ``ppo_trainer`` config."""
    try:
        import hydra
        from verl.trainer import main_ppo as verl_main
    except ImportError as exc:
        from trajstore.integrations.verl import INSTALL_HINT

        print(
            f"trajstore: the verl integration needs verl: {INSTALL_HINT} ({exc})", file=sys.stderr
        )
        raise SystemExit(2) from None
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    config_dir = os.path.join(os.path.dirname(verl_main.__file__), "config")
    hydra.main(config_path=config_dir, config_name="ppo_trainer", version_base=None)(run)()


if __name__ == "__main__":
    main()
