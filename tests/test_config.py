"""Configuration: file + environment + flags, validated whole, errors naming the path of the bad key."""

import json
from pathlib import Path

import pytest

from gateway.admission.config import hash_key
from gateway.config_load import ConfigError, env_overrides, load_config
from gateway.serve import main as serve_main


def test_defaults_need_no_file() -> None:
    cfg = load_config(environ={})
    assert cfg.server.port == 8000 and cfg.routing.policy == "cache-aware" and cfg.engines == []


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("server:\n  port: 9000\n  host: 0.0.0.0\nrouting:\n  policy: round-robin\n")
    cfg = load_config(path, environ={"KVGATE__SERVER__PORT": "9100"}, overrides={"routing": {"policy": "least-load"}})
    assert (cfg.server.port, cfg.server.host, cfg.routing.policy) == (9100, "0.0.0.0", "least-load")


def test_every_bad_key_is_named_by_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "server:\n  prot: 1\nengines:\n  - url: ftp://x\nrouting:\n  policy: nope\ntimeouts:\n  connect_s: -1\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    text = str(info.value)
    for path_part in ("server.prot", "engines.0.url", "routing.policy", "timeouts.connect_s"):
        assert path_part in text


def test_a_sections_own_check_names_the_full_path_of_the_key() -> None:
    """A check of a whole section (admission's tenants against its classes) names its keys below the section: the
    line starts with the key's full path, not the section's followed by a second path."""
    gold = {"a": {"keys": [hash_key("k")], "priority": "gold"}}
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"admission": {"tenants": gold}}, environ={})
    assert str(info.value).splitlines()[1:] == ["  admission.tenants.a.priority: unknown class 'gold'"]
    with pytest.raises(ConfigError, match=r"admission\.tenants\.b\.keys: .* prints a key's hash in that form$"):
        load_config(overrides={"admission": {"tenants": {"b": {"keys": ["plain"]}}}}, environ={})
    many = {name: {"keys": [hash_key(name)]} for name in "abc"}
    with pytest.raises(ConfigError, match=r"admission: 3 tenants, more than max_tenants \(2\)"):
        load_config(overrides={"admission": {"tenants": many, "max_tenants": 2}}, environ={})


def test_a_bad_routing_parameter_is_named_by_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "routing:\n  policy: cache-aware\n  params:\n    imbalance_cost: -1\n    session_max_gap: true\n"
        "    no_such_param: 1\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    lines = str(info.value).splitlines()
    assert any(line.strip().startswith("routing.params.imbalance_cost: ") and "0" in line for line in lines)
    assert any(line.strip().startswith("routing.params.session_max_gap: ") for line in lines)
    assert any(line.strip().startswith("routing.params.no_such_param: ") for line in lines)
    with pytest.raises(ConfigError, match=r"routing\.params\.imbalance_cost"):
        load_config(overrides={"routing": {"policy": "least-load", "params": {"imbalance_cost": 1}}}, environ={})
    params = {"imbalance_cost": 0, "session_max_gap": 8, "learn_queue_price": True}
    cfg = load_config(overrides={"routing": {"policy": "cache-aware", "params": params}}, environ={})
    assert cfg.routing.params == params


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml", environ={})


def test_env_override_parsing() -> None:
    tree = env_overrides({"KVGATE__RETRY__MAX_ATTEMPTS": "2", "KVGATE__SERVER__ROUTE_HEADERS": "false", "OTHER": "1"})
    assert tree == {"retry": {"max_attempts": 2}, "server": {"route_headers": False}}


@pytest.mark.parametrize("secret", ["123", "off", "abc: def", "#secret", "[x]"])
def test_a_string_key_from_the_environment_is_taken_as_written(secret: str) -> None:
    """YAML would read these as a number, a boolean, a mapping, a comment (null: the admin API off) and a list."""
    environ = {"KVGATE__ADMIN__KEY": secret, "KVGATE__ADMISSION__REDIS__URL": "redis://h:1/0"}
    environ["KVGATE__SERVER__PORT"] = "9"
    cfg = load_config(environ=environ)
    assert cfg.admin.key == secret and cfg.admission.redis is not None and cfg.server.port == 9


def test_unquoted_off_and_on_switch_the_access_log(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  access_log: off\n")  # YAML 1.1 reads this as false
    assert load_config(cfg, environ={}).server.access_log == "off"
    cfg.write_text("server:\n  access_log: on\n")
    assert load_config(cfg, environ={}).server.access_log == "plain"
    cfg.write_text("server:\n  access_log: json\n")
    assert load_config(cfg, environ={}).server.access_log == "json"
    cfg.write_text("server:\n  access_log: loud\n")
    with pytest.raises(ConfigError, match=r"server\.access_log"):
        load_config(cfg, environ={})


def test_an_engine_is_a_url_or_a_dns_name() -> None:
    cfg = load_config(overrides={"engines": [{"dns": {"name": "_http._tcp.vllm.ns.svc", "srv": True}, "name": "p"}]},
                      environ={})  # fmt: skip
    dns = cfg.engines[0].dns
    assert dns is not None and dns.srv and dns.port is None and dns.interval_s == 5.0 and cfg.engines[0].url is None
    for engine, message in (
        ({}, "exactly one of url and dns"),
        ({"url": "http://a:1", "dns": {"name": "a", "port": 1}}, "exactly one of url and dns"),
        ({"dns": {"name": "vllm"}}, "port is required unless srv"),
        ({"dns": {"name": "vllm", "port": 8000}, "kv_events_endpoint": "tcp://a:1"}, "dns.kv_events_port"),
        ({"dns": {"name": "vllm", "port": 70000}}, "engines.0.dns.port"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(overrides={"engines": [engine]}, environ={})


def test_one_engine_twice_is_a_config_error_with_its_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Spellings of one URL (issue 33): found by `kvgate serve --check`, not a traceback at start."""
    for first, second in (
        ("http://h:8000", "http://h:8000/"),
        ("http://H:8000//", "HTTP://h:8000"),
        ("http://h", "http://h:80"),
        ("https://h:443/v1", "https://h/v1/"),
    ):
        path = tmp_path / "kvgate.yaml"
        path.write_text(f"engines:\n  - url: {first}\n  - url: {second}\n")
        with pytest.raises(ConfigError, match=r"engines\.1\.url: duplicate engine: .* is also engines\.0\.url"):
            load_config(path, environ={})
        assert serve_main(["--config", str(path), "--check"]) == 2
        assert "engines.1.url: duplicate engine" in capsys.readouterr().err
    path.write_text("engines:\n  - url: http://a:1\n  - url: http://b:1\n    name: a:1\n")
    with pytest.raises(ConfigError, match=r"engines\.1\.name: duplicate replica id 'a:1'"):
        load_config(path, environ={})
    path.write_text("engines:\n  - url: http://a:1\n  - url: https://a:1\n")  # one replica id, two engines
    with pytest.raises(ConfigError, match=r"engines\.1\.url: duplicate replica id"):
        load_config(path, environ={})


def test_engine_urls_have_one_spelling() -> None:
    engines = [{"url": "HTTP://Engine-A:8000/"}, {"url": "https://b:443/v1/"}, {"url": "http://[::1]:80"}]
    cfg = load_config(overrides={"engines": engines}, environ={})
    assert [e.url for e in cfg.engines] == ["http://engine-a:8000", "https://b/v1", "http://[::1]"]
    for url, message in (
        ("http://h:8000?x=1", "no query"),
        ("http://:8000", "no host"),
        ("http://h:99999", "(?i)port"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(overrides={"engines": [{"url": url}]}, environ={})


def test_check_prints_the_configuration_without_its_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        "admin: {key: adm-secret}\n"
        "admission: {cache_salt_secret: salt-secret, redis: {url: 'redis://u:redis-secret@h:6379/0'}}\n"
        "tracing: {headers: {authorization: 'Bearer otlp-secret'}}\n"
    )
    assert serve_main(["--config", str(path), "--check"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert not any(v in json.dumps(printed) for v in ("adm-secret", "salt-secret", "redis-secret", "otlp-secret"))
    assert printed["admission"]["redis"]["url"] == "redis://u:<redacted>@h:6379/0"
    assert printed["admin"]["key"] == "<redacted>" and printed["tracing"]["headers"] == {"authorization": "<redacted>"}


def test_an_environment_override_reaches_a_key_the_file_spells_with_capitals(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("admission:\n  tenants:\n    TeamA: {limits: {requests_per_minute: 5}}\n")
    cfg = load_config(path, environ={"KVGATE__ADMISSION__TENANTS__TEAMA__LIMITS__REQUESTS_PER_MINUTE": "50"})
    assert list(cfg.admission.tenants) == ["TeamA"] and cfg.admission.tenants["TeamA"].limits.requests_per_minute == 50


def test_an_environment_value_that_is_not_yaml_is_a_config_error_naming_it() -> None:
    """It was a yaml ParserError traceback that named no variable."""
    with pytest.raises(ConfigError, match="KVGATE__SERVER__PORT: not a YAML value"):
        load_config(environ={"KVGATE__SERVER__PORT": "[1"})


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_bytes("# café\nserver: {port: 9100}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(path, environ={})


@pytest.mark.parametrize(("raw", "mode"), [("false", "off"), ("off", "off"), ("json", "json")])
def test_an_environment_value_means_what_it_means_in_the_file(raw: str, mode: str) -> None:
    """`access_log: false` is accepted in the file (YAML's false); the same in the environment was refused."""
    assert load_config(environ={"KVGATE__SERVER__ACCESS_LOG": raw}).server.access_log == mode
