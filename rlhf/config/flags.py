"""OpenRLHF-compatible flat command-line flags, parsed once into a typed config tree.

The parser is generated from the field metadata of the config dataclasses (`rlhf.config.shared_config` and the
job roots).
Flags of OpenRLHF that have no meaning here are accepted with a warning; flags of features this
build does not have yet are refused with a message saying so; anything else unknown is an error with
a "did you mean" hint. Flag errors are reported the `rlhf.config.errors` way: one short line per
problem from rank 0, exit status 2, no usage dump (`--help` prints the full usage). This module owns
parsing only; it never reads the parsed values itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import sys
import types
import typing
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from rlhf.config.errors import exit_usage
from rlhf.config.jobs import JOBS

IGNORED_FLAGS: dict[str, str] = {
    "vllm_sync_with_ray": "weights move in-process here; there is no Ray",
    "vllm_sync_backend": "weights are loaded into each rank's own engine in-process; no sync backend",
    "save_value_network": "train_ppo always saves the critic (HF format, under --save_path/critic)",
    "use_ms": "models and datasets are read from local paths only; nothing is downloaded (from ModelScope or the "
              "Hugging Face hub): pass local directories",
}
"""Flag -> why it is ignored, in every job (a root config adds its own: `JobConfig.IGNORED_FLAGS`). Value-taking
flags consume their value."""

IGNORED_SWITCHES = {"vllm_sync_with_ray", "save_value_network", "use_ms"}


REPULSE_FLAGS = tuple((
    "actor_loss_type alpha analytic_bad_word_calc bad_words base_actor_learning_rate custom_prompt "
    "do_harmlessness_training duplicate_rollout_batch_by evaluate_heldout_sampling fit_steps "
    "harmlessness_training_loss_type harmlessness_training_num_episodes heldout_cvar_fraction heldout_input_key "
    "heldout_prompt_data new_custom_single_prompt parameterization proposal_num_gpus_per_node proposal_num_nodes "
    "reinforce_baseline_type rew_trans_alpha rew_trans_beta reward_transform rm_max_len sampling_iters "
    "save_info_path save_negdata save_negdata_threshold save_steps_harmless target_dist_beta threshold "
    "use_base_as_proposal"
).split())
"""The RePULSe fork's `train_ppo` flags, which `train_ppo` does not know: an unknown-flag error names the module
that does (a unit test keeps the list equal to that module's own flags)."""
ELSEWHERE = "python -m rlhf.cli.train_repulse (the RePULSe fork's train_ppo)"
FORK_BOOKKEEPING_FLAGS = ("n_seeds_f_q", "no_test_info", "rm_type", "test_info_every")
"""The fork's flags that train_repulse accepts and ignores with a note (its test-info bookkeeping, its reward-model
switch); a unit test keeps them equal to that module's ignored fork flags."""


def fork_flags_in(argv: list[str]) -> list[str]:
    """The RePULSe fork's own flags in a command line, in order, each once: such a command is the fork's
    `train_ppo`, which `rlhf.cli.train_ppo` runs as `rlhf.cli.train_repulse`."""
    fork = set(REPULSE_FLAGS) | set(FORK_BOOKKEEPING_FLAGS)
    names = (token[2:].split("=", 1)[0] for token in argv if token.startswith("--"))
    return list(dict.fromkeys(f"--{name}" for name in names if name in fork))


JOB_CONFIGS = {job.name: tuple(job.root.split(":")) for job in JOBS if not job.fork}
"""Job (`python -m rlhf.cli.<job>`) -> (module, name) of its config root (from `rlhf.config.jobs.JOBS`; the RePULSe
fork's flags are explained apart), imported only to say which other jobs have a flag that the parsed one does not
(an OpenRLHF script passed to the wrong job gets that, not a look-alike of this job's flags)."""


TOOL_FLAGS = {
    "lora_combiner": ("model_path", "lora_path", "output_path", "is_rm", "param_dtype", "bf16", "value_head_prefix",
                      "trust_remote_code", "force"),
    "serve_rm": ("reward_pretrain", "remote_rm_url", "value_head_prefix", "bf16", "prm", "placeholder_token",
                 "reward_tokens", "prm_reduction", "normalize_reward", "max_len", "batch_size", "host", "port"),
}
"""The OpenRLHF flags of the tools with parsers of their own (a unit test keeps these equal to their --help)."""


def jobs_with_flag(name: str, config_cls: type) -> list[str]:
    """The jobs and tools other than `config_cls`'s whose parsers know --`name` (as a flag, an ignored flag or a
    refused one)."""
    import importlib

    jobs = []
    for job, (module, root) in JOB_CONFIGS.items():
        cls = getattr(importlib.import_module(module), root)
        if cls is not config_cls and (name in ignored_flags(cls)[0] or name in cls.PENDING_FLAGS
                                      or any(s.flag == name for s in flag_specs(cls))):
            jobs.append(job)
    return jobs + [tool for tool, flags in TOOL_FLAGS.items() if name in flags]


def ignored_flags(config_cls: type) -> tuple[dict[str, str], set[str]]:
    """(flag -> why it is ignored, the switches among them) for the job of `config_cls`."""
    return ({**IGNORED_FLAGS, **config_cls.IGNORED_FLAGS}, IGNORED_SWITCHES | set(config_cls.IGNORED_SWITCHES))



@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One flag: where its value goes in the tree and how argparse reads it."""

    flag: str
    path: tuple[str, ...]
    kind: type
    optional: bool
    default: Any
    help: str
    nargs: Any


def _scalar_type(annotation: Any) -> tuple[type, bool, Any]:
    """(element type, optional?, nargs-from-type) of a field annotation."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if origin is tuple:
        return typing.get_args(annotation)[0], optional, len(typing.get_args(annotation))
    return annotation, optional, None


def flag_specs(config_cls: type, prefix: tuple[str, ...] = (), defaults: Any = None, flag_prefix: str = "",
               help_vars: dict[str, str] | None = None) -> list[FlagSpec]:
    """Every flag of a config tree, depth first in field order. A sub-config's defaults are those of the
    instance its parent builds by default (so a job root can give a shared field its own default). A sub-config
    field may carry a `flag_prefix` (its flags are the prefix + its fields' flags: one placement type gives
    --actor_num_nodes and --critic_num_nodes) and `help_vars` (filled into its fields' help texts)."""
    specs = []
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            instance = getattr(defaults, f.name) if defaults is not None else f.default_factory()
            specs.extend(flag_specs(annotation, prefix + (f.name,), instance,
                                    flag_prefix + f.metadata.get("flag_prefix", ""),
                                    f.metadata.get("help_vars", help_vars)))
            continue
        kind, optional, type_nargs = _scalar_type(annotation)
        help_text = f.metadata.get("help", "")
        specs.append(FlagSpec(
            flag=flag_prefix + (f.metadata.get("flag") or f.name),
            path=prefix + (f.name,),
            kind=kind,
            optional=optional,
            default=(getattr(defaults, f.name) if defaults is not None
                     else f.default if f.default is not dataclasses.MISSING else f.default_factory()),
            help=help_text.format(**help_vars) if help_vars else help_text,
            nargs=f.metadata.get("nargs") or type_nargs,
        ))
    return specs


_VALUE_KINDS = {"int": "an integer", "float": "a number"}


class _FlagParser(argparse.ArgumentParser):
    """argparse, with its errors rephrased as `--flag: problem; fix` and reported by `exit_usage`. `argv`: the
    arguments being parsed (to tell a negative number taken for a flag)."""

    argv: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        exit_usage(self._rephrase(message))

    def _rephrase(self, message: str) -> str:
        match = re.fullmatch(r"argument (--\w+)(?:/\S+)?: (.*)", message)
        if match is None:
            return message
        flag, problem = match.groups()
        default = self.get_default(flag[2:])
        example = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        e_g = f", e.g. {flag} {example}" if example not in (None, "", False, True) else ""
        if m := re.fullmatch(r"invalid (\w+) value: (.*)", problem):
            return f"{flag} {m.group(2)} is not {_VALUE_KINDS.get(m.group(1), 'a ' + m.group(1))}; give one{e_g}"
        if m := re.fullmatch(r"expected (one|\d+) arguments?", problem):
            after = list(self.argv)[list(self.argv).index(flag) + 1:] if flag in self.argv else []
            if after and re.fullmatch(r"-(\d|\.\d|inf|nan).*", after[0]):  # argparse takes -1e-3 for a flag
                return f"{flag} takes a value, and {after[0]} reads as a flag: write {flag}={after[0]}"
            return f"{flag} takes {'a value' if m.group(1) == 'one' else m.group(1) + ' values'}{e_g}"
        if problem.startswith("ignored explicit argument"):
            return f"{flag} is a switch and takes no value: write {flag} alone"
        return f"{flag}: {problem}"


def build_parser(config_cls: type, prog: str) -> tuple[argparse.ArgumentParser, list[FlagSpec]]:
    """An argparse parser whose destinations are the flags of `config_cls`."""
    parser = _FlagParser(
        prog=prog, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Flags follow OpenRLHF's names. Ignored for compatibility: "
        + ", ".join(f"--{k}" for k in sorted(ignored_flags(config_cls)[0]))
        + (". Not implemented yet (refused): " + ", ".join(f"--{k}" for k in config_cls.PENDING_FLAGS)
           if config_cls.PENDING_FLAGS else ""),
    )
    specs = flag_specs(config_cls)
    for spec in specs:
        if spec.kind is bool:
            parser.add_argument(f"--{spec.flag}", action="store_true", default=spec.default, help=spec.help)
        else:
            parser.add_argument(f"--{spec.flag}", type=spec.kind, nargs=spec.nargs, default=spec.default,
                                help=spec.help, metavar=spec.flag.upper() if spec.nargs is None else None)
    return parser, specs


def _strip_ignored(argv: Sequence[str], config_cls: type) -> list[str]:
    """Remove the ignored flags of `config_cls`'s job (and their values) from argv, warning once for each."""
    ignored, switches = ignored_flags(config_cls)
    kept: list[str] = []
    i = 0
    while i < len(argv):
        name = argv[i][2:].split("=", 1)[0] if argv[i].startswith("--") else None
        if name in ignored:
            warnings.warn(f"--{name} is ignored: {ignored[name]}", stacklevel=3)
            takes_value = name not in switches and "=" not in argv[i]
            i += 2 if takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
            continue
        kept.append(argv[i])
        i += 1
    return kept


ANALOGUES = {"prompt_key": "input_key", "input_key": "prompt_key", "prompt_data": "dataset", "dataset": "prompt_data",
             "pretrain_data": "dataset", "learning_rate": "actor_learning_rate",
             "actor_learning_rate": "learning_rate"}
"""A flag of one job -> the flag that means the same in another (RL jobs read prompts, supervised ones rows)."""


def _explain_unknown(unknown: list[str], known_flags: list[str], config_cls: type, prog: str) -> list[str]:
    """One line per unknown flag or stray value, each with its fix."""
    pending = config_cls.PENDING_FLAGS
    lines = []
    for i, token in enumerate(unknown):
        if not token.startswith("--"):
            if i == 0 or not unknown[i - 1].startswith("--"):
                lines.append(f"unexpected value {token!r} (a flag before it takes no value, or too many values)")
            continue
        name = token[2:].split("=", 1)[0]
        if name in pending:
            lines.append(f"--{name} is an OpenRLHF flag whose feature is not implemented yet in this build")
            continue
        if (name in REPULSE_FLAGS or name in FORK_BOOKKEEPING_FLAGS) and name not in known_flags:
            lines.append(f"--{name} is a flag of {ELSEWHERE}: run that module instead")
            continue
        elsewhere = jobs_with_flag(name, config_cls)
        if elsewhere:
            analogue = ANALOGUES.get(name)
            fix = f"; did you mean --{analogue}?" if analogue in known_flags else "; see --help"
            lines.append(f"unknown flag --{name}: {prog} has no such flag ({', '.join(elsewhere)} "
                         f"{'has' if len(elsewhere) == 1 else 'have'} it){fix}")
            continue
        hint = difflib.get_close_matches(name, known_flags, n=1)
        lines.append(f"unknown flag --{name}" + (f"; did you mean --{hint[0]}?" if hint else "; see --help"))
    return lines


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _instantiate(config_cls: type, values: dict) -> Any:
    hints = typing.get_type_hints(config_cls)
    kwargs = {}
    for f in dataclasses.fields(config_cls):
        if f.name not in values:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _instantiate(hints[f.name], values[f.name])
        else:
            value = values[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return config_cls(**kwargs)


def parse_config(config_cls: type, argv: Sequence[str] | None = None, prog: str = "train") -> Any:
    """Parse OpenRLHF-style flags into an instance of `config_cls`.

    Raises SystemExit(2) (argparse convention) after printing one `error:` line per unknown flag or
    unreadable value (rank 0 only, see `rlhf.config.errors`), and `UsageError` (a ValueError) from the
    config's own validation on bad values.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, specs = build_parser(config_cls, prog)
    parser.argv = _strip_ignored(argv, config_cls)
    namespace, unknown = parser.parse_known_args(parser.argv)
    if unknown:
        exit_usage(_explain_unknown(unknown, [s.flag for s in specs], config_cls, prog))
    values: dict = {}
    for spec in specs:
        _set(values, spec.path, getattr(namespace, spec.flag))
    nonfinite = _nonfinite_floats(namespace, specs)
    if nonfinite:
        exit_usage(nonfinite)
    return _instantiate(config_cls, values)


def _nonfinite_floats(namespace: argparse.Namespace, specs: list[FlagSpec]) -> list[str]:
    """One line per float flag given inf or nan (argparse's float() accepts them; no setting means them)."""
    lines = []
    for spec in specs:
        value = getattr(namespace, spec.flag)
        items = value if isinstance(value, (list, tuple)) else [value]
        if spec.kind is float and any(isinstance(v, float) and not math.isfinite(v) for v in items):
            shown = " ".join(map(str, items))
            lines.append(f"--{spec.flag} {shown} is not a finite number; give a finite value")
    return lines
