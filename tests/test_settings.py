"""One declaration per setting (settings/fields.py), and every surface agreeing with it: the task
runner's keywords and sandbox_options, the sandbox block, the pool's variables and job
configuration, the CLI's flags. A surface that forgets a setting, shows one it declares
it leaves out, or words it differently fails here."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest
from prefect.workers.base import BaseJobConfiguration, BaseVariables
from pydantic import ValidationError

from guest_runner.conduit import LocalConduit
from prefect_resoluto.blocks import SandboxBlock
from prefect_resoluto.cli import UsageError, build_parser
from prefect_resoluto.cli.plan import check_flags
from prefect_resoluto.runtimes import RUNTIMES
from prefect_resoluto.settings import fields as settings
from prefect_resoluto.settings.config import SandboxConfig, check_conduit_fits
from prefect_resoluto.settings.fields import SETTINGS, Flag, Form, Omitted, Surface, exposed
from prefect_resoluto.task_runner.runner import ResolutoTaskRunner, sandbox_options
from prefect_resoluto.worker.worker import ResolutoJobConfiguration, ResolutoWorker, ResolutoWorkerVariables

#: The block's fields that are no sandbox setting: one per option of a runtime that has any
#: (the declaration of runtime_options says so).
RUNTIME_OPTION_FIELDS = {
    "kube_namespace",
    "kube_context",
    "runtime_class",
    "service_account",
    "priority_class",
    "node_selector",
    "tolerations",
    "store_egress_cidr",
    "store_egress_port",
    "store_credentials_secret",
    "solari_base_url",
    "solari_api_key",
    "solari_template",
    "solari_conduit_mode",
    "solari_session_timeout_s",
    "solari_metadata",
}
#: The pool's variables that are the worker's own, not sandbox settings.
WORKER_VARIABLES = {
    "secret_env_block",
    "sandbox",
    "working_dir",
    "stream_output",
    "api_gateway_address",
    "run_overridable",
}


def _form(name: str, surface: Surface) -> Form:
    s = SETTINGS[name]
    form = s.block if surface is Surface.BLOCK else s.pool
    assert isinstance(form, Form)
    return form


def _node_parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in ("run", "render")}


def test_every_field_of_the_settings_is_declared_and_every_omission_says_why():
    assert [f.name for f in dataclasses.fields(SandboxConfig)] == list(SETTINGS)
    for name, s in SETTINGS.items():
        assert s.title and s.description, name
        for where in (s.block, s.pool, s.cli, s.runner):
            if isinstance(where, Omitted):
                assert len(where.why) > 10, f"{name}: an omission without its reason"


def test_the_runner_takes_each_setting_as_a_keyword_and_refuses_any_other():
    params = list(inspect.signature(ResolutoTaskRunner).parameters)
    assert [p for p in params if p not in ("sandbox", "max_workers")] == exposed(Surface.RUNNER)
    with pytest.raises(TypeError, match="unexpected keyword argument 'memroy'"):
        ResolutoTaskRunner(memroy="1Gi")
    runner = ResolutoTaskRunner(memory="1Gi", egress=["example.com"], max_workers=2)
    assert runner.duplicate() == runner
    with pytest.raises(TypeError, match="unknown sandbox option 'memroy'"):
        with sandbox_options(memroy="1Gi"):
            pass


def test_the_block_shows_each_block_setting_with_its_declared_title_and_description():
    props = SandboxBlock.model_json_schema()["properties"]
    shown = [name for name in props if name not in RUNTIME_OPTION_FIELDS]
    assert shown == exposed(Surface.BLOCK), "the block's settings, in declaration order"
    for name in exposed(Surface.BLOCK):
        form = _form(name, Surface.BLOCK)
        assert props[name]["title"] == (form.title or SETTINGS[name].title), name
        assert props[name]["description"] == (form.description or SETTINGS[name].description), name
    # Every block setting reaches the settings the block produces.
    cfg = SandboxBlock(
        memory="1Gi", cpus="3", disk="2Gi", pids=99, warm_pool=0, egress=["a.example"]
    ).to_config()
    assert (cfg.memory, cfg.cpus, cfg.disk, cfg.pids, cfg.warm_pool, cfg.egress) == (
        "1Gi",
        "3",
        "2Gi",
        99,
        0,
        ["a.example"],
    )


def test_the_pool_shows_each_pool_setting_and_its_job_configuration_takes_it():
    variables = ResolutoWorkerVariables.model_fields
    own = set(BaseVariables.model_fields)
    shown = [name for name in variables if name not in own and name not in WORKER_VARIABLES]
    assert shown == exposed(Surface.POOL)
    for name, s in SETTINGS.items():
        if isinstance(s.pool, Omitted) and name not in own:
            assert name not in variables, f"{name} is declared out of the pool ({s.pool.why}) but shown"
    job = set(ResolutoJobConfiguration.model_fields) - set(BaseJobConfiguration.model_fields)
    assert job == set(variables) - own, "the job configuration takes every variable, and only those"
    template = ResolutoWorker.get_default_base_job_template()
    for name in exposed(Surface.POOL):
        assert template["job_configuration"][name] == "{{ " + name + " }}"
        prop = template["variables"]["properties"][name]
        assert prop["title"] == (_form(name, Surface.POOL).title or SETTINGS[name].title)
        assert prop["description"] == (_form(name, Surface.POOL).description or SETTINGS[name].description)
    # Every registered runtime is a pool choice or left out with its reason.
    assert set(RUNTIMES) == set(settings.POOL_RUNTIMES) | set(settings.NOT_POOL_RUNTIMES)
    assert not set(settings.POOL_RUNTIMES) & set(settings.NOT_POOL_RUNTIMES)


def test_run_and_render_have_a_flag_for_each_cli_setting():
    for command, parser in _node_parsers().items():
        flags = {opt: action for action in parser._actions for opt in action.option_strings}
        for name, s in SETTINGS.items():
            if isinstance(s.cli, Flag):
                action = flags.get(s.cli.flag)
                assert action is not None, f"{command} has no {s.cli.flag} for {name}"
                assert (action.dest, action.help) == (s.cli.dest, s.cli.help)
            else:
                assert "--" + name.replace("_", "-") not in flags, f"{name} is declared out of the CLI"


@pytest.mark.parametrize(
    ("name", "value", "flag_value"),
    [
        ("memory", "lots", "lots"),
        ("cpus", "many", "many"),
        ("disk", "a lot", "a lot"),
        ("output_limit", "big", "big"),
        ("pids", 0, "0"),
        ("silence_window", -1.0, "-1"),
        ("silence_window", float("nan"), "nan"),
        ("min_isolation", "hyper", "hyper"),
    ],
)
def test_a_bad_value_is_refused_by_the_settings_own_check_on_every_surface(name, value, flag_value):
    with pytest.raises(ValueError) as by_config:
        SandboxConfig(**{name: value})
    with pytest.raises(ValueError):
        ResolutoTaskRunner(**{name: value})
    flag = SETTINGS[name].cli
    assert isinstance(flag, Flag)
    args = build_parser().parse_args(["run", flag.flag, flag_value, "--", "true"])
    with pytest.raises(UsageError) as by_cli:
        check_flags(args)
    assert flag.flag in str(by_cli.value)
    reason = str(by_config.value).removeprefix(name)
    assert reason.split(":")[-1].strip() in str(by_cli.value), "the CLI says what the settings say"
    form = SETTINGS[name].pool
    if isinstance(form, Form) and form.check:
        with pytest.raises(ValidationError):
            ResolutoWorkerVariables(**{name: value})


def test_which_conduit_fits_which_runtime_is_one_rule_for_the_runner_and_the_cli(tmp_path):
    pytest.importorskip("kubernetes")
    from prefect_resoluto.cli.plan import plan_node
    from prefect_resoluto.cli.render import render_runtime

    local = LocalConduit(tmp_path / "conduit")
    kube = RUNTIMES["kubernetes"](namespace="sandboxes", image="img:1")
    with pytest.raises(ValueError) as by_runner:
        SandboxConfig().check_conduit_fits(kube, local)
    with pytest.raises(ValueError) as by_rule:
        check_conduit_fits(kube, local)
    args = build_parser().parse_args(
        ["render", "--runtime", "kubernetes", "--image", "img:1", "--conduit", local.url, "--", "true"]
    )
    with pytest.raises(UsageError) as by_cli:
        plan_node(args, render_runtime, fresh=False)
    assert str(by_runner.value) == str(by_rule.value) == str(by_cli.value)
