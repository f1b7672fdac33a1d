"""Every flag of OpenRLHF v0.9.5's command-line scripts is known to the job that stands in for the script: it
works, is accepted with a one-line note, or is refused as not built. `tests/openrlhf_v095_flags.json` lists each
script's flags; it was generated once from the v0.9.5 sources (openrlhf/cli/<script>.py of that tag, every
`parser.add_argument("--flag", ...)`), so a flag this build forgets shows up here as a failure."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest

from rlhf.config.flags import TOOL_FLAGS, _explain_unknown, flag_specs, ignored_flags, parse_config
from rlhf.config.inference_config import BatchInferenceConfig
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.config.preference_config import TrainDPOConfig, TrainKTOConfig
from rlhf.config.supervised_config import TrainKDConfig, TrainPRMConfig, TrainRMConfig, TrainSFTConfig

V095_FLAGS_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "openrlhf_v095_flags.json")

JOB_OF_SCRIPT = {"train_ppo_ray": TrainPPOConfig, "train_sft": TrainSFTConfig, "train_rm": TrainRMConfig,
                 "train_prm": TrainPRMConfig, "train_dpo": TrainDPOConfig, "train_kto": TrainKTOConfig,
                 "train_kd": TrainKDConfig, "batch_inference": BatchInferenceConfig}
"""v0.9.5 script -> our config root (train_ppo_ray is `python -m rlhf.cli.train_ppo`)."""
BASE_ARGV = {"batch_inference": ["--eval_task", "generate", "--output_path", "out.jsonl"]}
"""What a script needs besides the flag under test to parse."""

def v095_flags() -> dict[str, list[str]]:
    with open(V095_FLAGS_FILE) as f:
        return json.load(f)


def how_known(config_cls: type, flag: str) -> str | None:
    """"works", "ignored" or "refused" for a flag name without dashes; None when the job does not know it."""
    if any(spec.flag == flag for spec in flag_specs(config_cls)):
        return "works"
    if flag in ignored_flags(config_cls)[0]:
        return "ignored"
    if flag in config_cls.PENDING_FLAGS:
        return "refused"
    return None


def tool_flags(main, capsys) -> set[str]:
    """The flags a tool's own argparse parser lists in its --help (read from the help text, printed nowhere)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    return set(re.findall(r"^\s+(--\w+)", capsys.readouterr().out, re.MULTILINE)) - {"--help"}


def test_every_v095_flag_is_known_to_its_job(capsys):
    scripts = v095_flags()
    assert set(JOB_OF_SCRIPT) | {"serve_rm", "lora_combiner"} == set(scripts)
    unknown = {script: [f for f in scripts[script] if how_known(cls, f[2:]) is None]
               for script, cls in JOB_OF_SCRIPT.items()}
    assert unknown == dict.fromkeys(JOB_OF_SCRIPT, [])
    from rlhf.cli.lora_combiner import parse_args

    assert set(scripts["lora_combiner"]) <= tool_flags(parse_args, capsys)
    assert capsys.readouterr() == ("", "")


def test_serve_rm_knows_every_v095_flag(capsys):
    from rlhf.cli.serve_rm import main

    missing = set(v095_flags()["serve_rm"]) - tool_flags(main, capsys)
    assert missing == set(), missing


def test_tool_flags_used_for_hints_are_the_tools_own(capsys):
    """`TOOL_FLAGS` (named when a tool's flag is passed to a training job) holds only flags those parsers have."""
    from rlhf.cli.lora_combiner import parse_args
    from rlhf.cli.serve_rm import main

    assert {f"--{f}" for f in TOOL_FLAGS["lora_combiner"]} == tool_flags(parse_args, capsys)
    assert {f"--{f}" for f in TOOL_FLAGS["serve_rm"]} <= tool_flags(main, capsys)


def test_ignored_flags_parse_with_one_note_each():
    """Each v0.9.5 flag a job accepts with a note parses (a value-taking one with its value) and warns once, naming
    itself; nothing else is warned."""
    scripts = v095_flags()
    for script, cls in JOB_OF_SCRIPT.items():
        notes, switches = ignored_flags(cls)
        for flag in (f[2:] for f in scripts[script] if how_known(cls, f[2:]) == "ignored"):
            argv = ([f"--{flag}"] if flag in switches else [f"--{flag}", "x"]) + BASE_ARGV.get(script, [])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                parse_config(cls, argv)
            assert [str(w.message) for w in caught] == [f"--{flag} is ignored: {notes[flag]}"], (script, flag)


def test_a_flag_of_another_job_names_that_job_not_a_look_alike():
    """An OpenRLHF flag passed to the wrong job says which jobs have it, instead of difflib's nearest name of this
    job (KTO's --prompt_key used to suggest --output_key, an unknown --ema_beta --adam_betas), and this job's flag
    of the same meaning where it has one (KTO reads its prompts with --input_key)."""
    kto = [s.flag for s in flag_specs(TrainKTOConfig)]
    assert _explain_unknown(["--prompt_key"], kto, TrainKTOConfig, "train_kto") == [
        "unknown flag --prompt_key: train_kto has no such flag (train_rm, train_dpo, train_simpo, train_orpo, "
        "train_cpo have it); did you mean --input_key?"]
    sft = [s.flag for s in flag_specs(TrainSFTConfig)]
    assert _explain_unknown(["--ema_beta", "--lora_path"], sft, TrainSFTConfig, "train_sft") == [
        "unknown flag --ema_beta: train_sft has no such flag (train_ppo has it); see --help",
        "unknown flag --lora_path: train_sft has no such flag (lora_combiner has it); see --help"]
    assert _explain_unknown(["--learnig_rate"], sft, TrainSFTConfig, "train_sft") == [
        "unknown flag --learnig_rate; did you mean --learning_rate?"]
