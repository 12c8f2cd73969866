"""Request options (structspec/options.py): bounds, unknown keys, the concrete check, server
defaults, and the API documenting exactly these bounds."""

from __future__ import annotations

import pytest

from structspec.config import Settings
from structspec.options import (AUTO, JOB_STRATEGIES, OPTION_NAMES, SPECS, STRATEGIES, OptionError,
                                RequestOptions)

NUMERIC = [name for name, spec in SPECS.items() if spec.minimum is not None]


def error_of(opts: RequestOptions, concrete: bool = False) -> OptionError:
    with pytest.raises(OptionError) as e:
        opts.check(concrete=concrete)
    return e.value


def test_every_field_has_a_spec_and_only_numbers_have_bounds():
    assert OPTION_NAMES == tuple(f for f in RequestOptions.__dataclass_fields__)
    assert NUMERIC == ["draft_len", "temperature", "seed", "max_tokens", "timeout_s"]
    assert all(SPECS[n].maximum is not None for n in NUMERIC)
    assert SPECS["strategy"].choices == JOB_STRATEGIES == (AUTO, *STRATEGIES)


def test_strategies_are_the_engines_proposers():
    from structspec.engine.proposers import PROPOSERS, make_proposer

    assert tuple(PROPOSERS) == STRATEGIES
    assert [make_proposer(s).name for s in STRATEGIES] == list(STRATEGIES)


@pytest.mark.parametrize("name", NUMERIC)
def test_bounds_are_inclusive_and_a_value_outside_names_the_option(name):
    spec = SPECS[name]
    for inside in (spec.minimum, spec.maximum):
        RequestOptions(**{name: inside}).check()
    step = 0.5 if name == "temperature" else 1
    for outside in (spec.minimum - step, spec.maximum + step):
        e = error_of(RequestOptions(**{name: outside}))
        assert e.option == name
        assert str(e) == f"{name} must be between {int(spec.minimum)} and {int(spec.maximum)}, not {outside}"


def test_exact_messages_for_each_kind_of_bad_value():
    cases = [
        (RequestOptions(strategy="psychic"), "strategy",
         "strategy must be one of auto, none, schema, ngram, suffix, composite, not 'psychic'"),
        (RequestOptions(draft_len=99), "draft_len", "draft_len must be between 0 and 64, not 99"),
        (RequestOptions(draft_len=2.5), "draft_len", "draft_len must be an integer, not 2.5"),
        (RequestOptions(max_tokens=True), "max_tokens", "max_tokens must be an integer, not True"),
        (RequestOptions(temperature="hot"), "temperature", "temperature must be a number, not 'hot'"),
        (RequestOptions(temperature=10.5), "temperature", "temperature must be between 0 and 10, not 10.5"),
        (RequestOptions(seed=1.0), "seed", "seed must be an integer, not 1.0"),
        (RequestOptions(seed=False), "seed", "seed must be an integer, not False"),
        (RequestOptions(verbatim="yes"), "verbatim", "verbatim must be true or false, not 'yes'"),
        (RequestOptions(chunking="always"), "chunking", "chunking must be one of off, auto, not 'always'"),
        (RequestOptions(timeout_s=0), "timeout_s", "timeout_s must be between 1 and 86400, not 0"),
        (RequestOptions(timeout_s=2.5), "timeout_s", "timeout_s must be an integer, not 2.5"),
    ]
    for opts, option, message in cases:
        e = error_of(opts)
        assert (e.option, str(e)) == (option, message)
        assert isinstance(e, ValueError)  # callers that catch ValueError keep working


def test_an_integer_temperature_is_a_number():
    assert RequestOptions(temperature=1).check().temperature == 1


def test_check_returns_the_options_unchanged():
    opts = RequestOptions(strategy="ngram", draft_len=3, seed=7)
    assert opts.check() is opts


def test_from_dict_refuses_unknown_keys_naming_the_first():
    with pytest.raises(OptionError) as e:
        RequestOptions.from_dict({"strategy": "auto", "zeta": 1, "beam": 4})
    assert e.value.option == "beam"
    assert str(e.value) == ("unknown option 'beam'; options are strategy, draft_len, temperature, seed, "
                            "max_tokens, verbatim, chunking, timeout_s")


def test_from_dict_reads_none_and_missing_as_defaults_and_round_trips_as_dict():
    assert RequestOptions.from_dict(None) == RequestOptions.from_dict({}) == RequestOptions()
    assert RequestOptions.from_dict({"strategy": None, "draft_len": None, "verbatim": None}) == RequestOptions()
    opts = RequestOptions(strategy="schema", draft_len=4, temperature=0.7, seed=3, max_tokens=64, verbatim=True)
    assert tuple(opts.as_dict()) == OPTION_NAMES
    assert RequestOptions.from_dict(opts.as_dict()) == opts


def test_from_dict_does_not_check_bounds():
    assert RequestOptions.from_dict({"draft_len": 999}).draft_len == 999  # check() does


def test_concrete_refuses_auto_and_unset_draft_len_max_tokens_or_timeout():
    full = RequestOptions(strategy="ngram", draft_len=4, max_tokens=64, timeout_s=30)
    assert full.check(concrete=True) is full
    e = error_of(full.replace(strategy=AUTO), concrete=True)
    assert (e.option, str(e)) == ("strategy", "strategy must be one of none, schema, ngram, suffix, composite, not 'auto'")
    e = error_of(full.replace(draft_len=None), concrete=True)
    assert (e.option, str(e)) == ("draft_len", "draft_len must be set")
    e = error_of(full.replace(max_tokens=None), concrete=True)
    assert (e.option, str(e)) == ("max_tokens", "max_tokens must be set")
    e = error_of(full.replace(timeout_s=None), concrete=True)
    assert (e.option, str(e)) == ("timeout_s", "timeout_s must be set")
    assert full.replace(strategy=AUTO, draft_len=None, max_tokens=None).check() is not None  # not concrete: fine


def test_with_defaults_fills_max_tokens_timeout_and_a_fixed_strategys_draft_len_only():
    settings = Settings(draft_len=6, max_tokens=300, job_timeout_s=45)
    assert RequestOptions().with_defaults(settings) == RequestOptions(strategy=AUTO, draft_len=None, max_tokens=300,
                                                                      timeout_s=45)
    assert RequestOptions(strategy="schema").with_defaults(settings) == RequestOptions(
        strategy="schema", draft_len=6, max_tokens=300, timeout_s=45)
    given = RequestOptions(strategy="ngram", draft_len=0, temperature=0.5, seed=1, max_tokens=9, verbatim=True,
                           timeout_s=3)
    assert given.with_defaults(settings) == given
    assert RequestOptions(draft_len=3).with_defaults(settings).draft_len == 3  # auto at a given k
    assert RequestOptions(strategy="none").with_defaults(settings).check(concrete=True).draft_len == 6


def test_request_options_are_immutable():
    with pytest.raises(AttributeError):
        RequestOptions().strategy = "none"


# --- the API documents exactly these options ----------------------------------------------------

@pytest.fixture(scope="module")
def openapi(tmp_path_factory) -> dict:
    from structspec.api.app import create_app

    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("openapi")))
    return app.openapi_schema.to_schema()


def documented(schema: dict) -> dict:
    return {k: schema[k] for k in ("minimum", "maximum", "enum") if k in schema}


def expected(name: str, nullable: bool = True) -> dict:
    spec = SPECS[name]
    out = {k: v for k, v in (("minimum", spec.minimum), ("maximum", spec.maximum)) if v is not None}
    if spec.choices is not None:
        out["enum"] = [*spec.choices, None] if nullable else list(spec.choices)
    return out


def test_job_options_openapi_documents_exactly_the_specs(openapi):
    schema = openapi["components"]["schemas"]["JobOptions"]
    assert set(schema["properties"]) == set(OPTION_NAMES)
    assert schema["required"] == [] and schema["additionalProperties"] is False
    for name, spec in SPECS.items():
        prop = schema["properties"][name]
        assert documented(prop) == expected(name), name
        assert prop["description"] == spec.help, name


def test_batch_query_parameters_and_the_pin_document_the_same_bounds(openapi):
    params = {p["name"]: p["schema"] for p in openapi["paths"]["/v1/batches"]["post"]["parameters"]}
    for name in OPTION_NAMES:
        assert documented(params[name]) == expected(name), name
    pin = openapi["components"]["schemas"]["StrategyPin"]["properties"]
    assert documented(pin["strategy"]) == expected("strategy", nullable=False)
    assert documented(pin["draft_len"]) == expected("draft_len")


def test_job_options_do_not_enforce_bounds_the_service_checks():
    """msgspec only documents the bounds: the service answers 422 naming the option itself."""
    import msgspec

    from structspec.api.structs import JobOptions

    opts = msgspec.json.decode(b'{"draft_len": 999, "strategy": "psychic", "max_tokens": 0}', type=JobOptions)
    assert (opts.draft_len, opts.strategy, opts.max_tokens) == (999, "psychic", 0)


def test_the_servers_time_limit_settings_are_refused_out_of_bounds_naming_the_variable():
    from structspec.config import SettingsError

    for env, message in [({"STRUCTSPEC_JOB_TIMEOUT_S": "0"}, "STRUCTSPEC_JOB_TIMEOUT_S must be between 1 and 86400, not 0"),
                         ({"STRUCTSPEC_JOB_TIMEOUT_S": "86401"},
                          "STRUCTSPEC_JOB_TIMEOUT_S must be between 1 and 86400, not 86401"),
                         ({"STRUCTSPEC_ENGINE_WATCHDOG_S": "0"}, "STRUCTSPEC_ENGINE_WATCHDOG_S must be at least 1, not 0")]:
        with pytest.raises(SettingsError) as e:
            Settings.from_env(env)
        assert str(e.value) == message
    assert Settings.from_env({"STRUCTSPEC_JOB_TIMEOUT_S": "86400"}).job_timeout_s == 86400
