"""The CLI commands, the dev key, the price table, redaction, and the upstream proxy."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from sluice.cli import main
from sluice.gateway.cli import parse_time, price_file
from sluice.gateway.dev import ensure_dev_key
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.pricing import PriceTable
from sluice.gateway.proxy import UpstreamProxy
from sluice.gateway.redact import default_redactor
from sluice.gateway.store import KeySettings, SQLStore, UsageQuery, UsageRecord
from sluice.protocol.errors import InvalidRequestError

from .conftest import CHAT, make_state, new_key, serve
from .stub import StubUpstream


def test_cli_tenants_keys_usage_purge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = ["--database-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    assert main(["tenants", "create", "acme", "--rpm", "5", "--budget-usd", "2.5",
                 "--priority-class", "batch", *db]) == 0
    assert main(["tenants", "update", "acme", "--tpm", "900", *db]) == 0
    capsys.readouterr()
    assert main(["tenants", "list", "--json", *db]) == 0
    [tenant] = json.loads(capsys.readouterr().out)
    assert (tenant["rpm"], tenant["tpm"], tenant["budget_usd"], tenant["priority_class"]) == (
        5, 900, 2.5, "batch")
    assert main(["keys", "create", "--tenant", "acme", "--name", "ci", "--rpm", "2", *db]) == 0
    key = capsys.readouterr().out.strip()
    store = SQLStore(db[1])
    principal = store.authenticate(key)
    assert principal is not None and principal.key.settings.rpm == 2
    assert main(["keys", "list", "--json", *db]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert key not in json.dumps(listed) and listed["name"] == "ci"
    store.record_usage(UsageRecord(request_id="old", tenant_id=principal.tenant.id,
                                   key_id=principal.key.id, endpoint="/v1/completions",
                                   model="m", status="ok", http_status=200, ts=1000.0))
    store.record_usage(UsageRecord(request_id="new", tenant_id=principal.tenant.id,
                                   key_id=principal.key.id, endpoint="/v1/completions",
                                   model="m", status="ok", http_status=200, prompt_tokens=3))
    assert main(["usage", "--tenant", "acme", "--since", "1d", "--json", *db]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["request_id"] for r in out["data"]] == ["new"] and out["totals"]["prompt_tokens"] == 3
    assert main(["usage", "--tenant", "acme", "--limit", "1", "--json", *db]) == 0
    out = json.loads(capsys.readouterr().out)  # totals of both records, not only the one shown
    assert [r["request_id"] for r in out["data"]] == ["old"] and out["has_more"] is True
    assert out["totals"]["requests"] == 2 and out["totals"]["prompt_tokens"] == 3
    assert main(["usage", "--tenant", "acme", "--limit", "1", *db]) == 0
    assert '"requests": 2' in (text := capsys.readouterr().out) and "1 shown, --limit 1" in text
    assert main(["gateway", "purge", "--older-than", "30", *db]) == 0
    assert "deleted 1" in capsys.readouterr().out
    assert main(["keys", "revoke", listed["id"], *db]) == 0
    assert store.authenticate(key) is None
    assert main(["keys", "create", "--tenant", "nobody", *db]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["gateway", *db]) == 2  # no --upstream


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:1/test", "nodriver://x"])
def test_cli_reports_a_database_it_cannot_use_in_one_line(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An unreachable database, or a URL naming no driver, was a ~100-line traceback."""
    assert main(["tenants", "list", "--database-url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the gateway database: ") and err.count("\n") == 1, err


def test_cli_tenants_update_lifts_a_limit_or_budget_given_as_none(tmp_path: Path) -> None:
    """A limit or budget once set could not be removed from the command line (only
    raised); `none` lifts it, and leaves the other settings as they are."""
    db = ["--database-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    assert main(["tenants", "create", "acme", "--rpm", "5", "--tpm", "900",
                 "--budget-usd", "3", "--soft-budget-usd", "2", *db]) == 0
    assert main(["tenants", "update", "acme", "--rpm", "none", "--budget-usd", "None",
                 "--soft-budget-usd", "none", *db]) == 0
    settings = SQLStore(db[1]).get_tenant("acme").settings
    assert (settings.rpm, settings.tpm, settings.budget_usd, settings.soft_budget_usd) == (
        None, 900, None, None)
    assert main(["keys", "create", "--tenant", "acme", "--max-concurrent", "none", *db]) == 0


def test_cli_keys_update_changes_a_key_in_place(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A key's settings could only be set when it was minted; `keys update` changes
    them (the plaintext stays the same), `none` lifting a limit or the model list."""
    db = ["--database-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    assert main(["tenants", "create", "acme", *db]) == 0
    capsys.readouterr()
    assert main(["keys", "create", "--tenant", "acme", "--rpm", "5", *db]) == 0
    plaintext = capsys.readouterr().out.strip()
    store = SQLStore(db[1])
    [key] = store.list_keys()
    assert main(["keys", "update", key.id, "--rpm", "none", "--tpm", "900", "--name", "ci",
                 "--allowed-models", "m1,m2", "--priority-class", "batch", *db]) == 0
    principal = store.authenticate(plaintext)
    assert principal is not None and principal.key.settings == KeySettings(
        name="ci", rpm=None, tpm=900, allowed_models=("m1", "m2"), priority_class="batch")
    assert main(["keys", "update", key.id, "--allowed-models", "none", *db]) == 0
    assert store.list_keys()[0].settings.allowed_models is None
    capsys.readouterr()
    assert main(["keys", "update", "key_nope", "--rpm", "1", *db]) == 1
    assert "not found" in capsys.readouterr().err


def test_cli_keys_list_table_shows_concurrency_and_models(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The table left out `max_concurrent` and `allowed_models` (only --json had them)."""
    db = ["--database-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    assert main(["tenants", "create", "acme", *db]) == 0
    assert main(["keys", "create", "--tenant", "acme", "--max-concurrent", "7",
                 "--allowed-models", "m1,m2", *db]) == 0
    assert main(["keys", "create", "--tenant", "acme", *db]) == 0
    capsys.readouterr()
    assert main(["keys", "list", *db]) == 0
    header, limited, free = capsys.readouterr().out.splitlines()
    assert header.split()[-3:] == ["max_concurrent", "allowed_models", "revoked"]
    assert limited.split()[-3:] == ["7", "m1,m2", "False"]
    assert free.split()[-3:] == ["None", "None", "False"]


def test_cli_tenants_delete_revokes_its_keys_and_keeps_its_usage(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """There was no way to delete a tenant: `tenants delete` revokes its keys at once
    and keeps its ledger records (still read by its name); exit 1 for an unknown one."""
    db = ["--database-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    assert main(["tenants", "create", "acme", *db]) == 0
    capsys.readouterr()
    assert main(["keys", "create", "--tenant", "acme", *db]) == 0
    plaintext = capsys.readouterr().out.strip()
    store = SQLStore(db[1])
    principal = store.authenticate(plaintext)
    assert principal is not None
    store.record_usage(UsageRecord(request_id="r", tenant_id=principal.tenant.id,
                                   key_id=principal.key.id, endpoint="/v1/completions",
                                   model="m", status="ok", http_status=200))
    assert main(["tenants", "delete", "acme", *db]) == 0
    assert "revoked 1 key(s)" in capsys.readouterr().out
    assert store.authenticate(plaintext) is None
    assert store.list_tenants() == []
    assert main(["usage", "--tenant", "acme", "--json", *db]) == 0
    assert [r["request_id"] for r in json.loads(capsys.readouterr().out)["data"]] == ["r"]
    assert main(["keys", "list", "--tenant", "acme", "--json", *db]) == 0
    assert [k["revoked"] for k in json.loads(capsys.readouterr().out)] == [True]
    assert main(["tenants", "delete", "acme", *db]) == 1
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["tenants", "delete", *db])
    assert exc.value.code == 2


def test_cli_allowed_models_none_lifts_the_list(tmp_path: Path) -> None:
    """`--allowed-models none` allowed one model named "none" (so none of the real ones),
    and nothing on the command line could lift a list once set; `none` lifts it now, as
    it does a limit, and an empty value (which was ignored) is a usage error."""
    db = ["--database-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    assert main(["tenants", "create", "acme", "--allowed-models", "a, b", *db]) == 0
    assert SQLStore(db[1]).get_tenant("acme").settings.allowed_models == ("a", "b")
    assert main(["tenants", "update", "acme", "--allowed-models", "none", "--rpm", "3", *db]) == 0
    settings = SQLStore(db[1]).get_tenant("acme").settings
    assert (settings.allowed_models, settings.rpm) == (None, 3)
    with pytest.raises(SystemExit) as exc:
        main(["keys", "create", "--tenant", "acme", "--allowed-models", " , ", *db])
    assert exc.value.code == 2


def test_parse_time_forms() -> None:
    assert parse_time("24h", now=100000.0) == 100000.0 - 86400
    assert parse_time("1700000000") == 1700000000.0
    assert parse_time("2024-01-01T00:00:00+00:00") == 1704067200.0
    assert parse_time(None) is None
    for bad in ("1x", "nan", "1e400", "-5h"):
        with pytest.raises(ValueError, match="is not a time"):
            parse_time(bad)


@pytest.mark.parametrize(("argv", "flag"), [
    (["usage", "--since", "1x"], "--since"),  # was a ValueError traceback
    (["usage", "--until", "yesterday"], "--until"),
    (["usage", "--since", "nan"], "--since"),  # was exit 1 from the store's check
    (["usage", "--limit", "0"], "--limit"),
    (["usage", "--limit", "100001"], "--limit"),
    (["usage", "--limit", "ten"], "--limit"),
    (["gateway", "purge", "--older-than", "-3"], "--older-than"),  # purged the future
    (["gateway", "purge", "--older-than", "nan"], "--older-than"),
    (["tenants", "create", "acme", "--rpm", "-1"], "--rpm"),
    (["tenants", "create", "acme", "--budget-usd", "nan"], "--budget-usd"),  # was accepted
    (["tenants", "update", "acme", "--soft-budget-usd", "-1"], "--soft-budget-usd"),
    (["keys", "create", "--tenant", "acme", "--tpm", "1.5"], "--tpm"),
    (["keys", "create", "--tenant", "acme", "--max-concurrent", "x"], "--max-concurrent"),
    (["tenants", "create", "acme", "--allowed-models", ""], "--allowed-models"),
    (["gateway", "--port", "70000"], "--port"),
    (["gateway", "--upstream", "http://x", "--prices", "/nonexistent.yaml"], "--prices"),
])
def test_cli_bad_values_are_usage_errors(argv: list[str], flag: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A value a flag cannot take is argparse's usage error: one line on stderr naming
    the flag, exit status 2, no traceback, nothing done to the database."""
    db = ["--database-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, *db])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and "Traceback" not in err
    assert not (tmp_path / "cli.db").exists()


def test_cli_bad_price_table_is_a_usage_error(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    prices = tmp_path / "prices.yaml"
    prices.write_text("m: [1, 2]\n")
    with pytest.raises(SystemExit) as exc:
        main(["gateway", "--upstream", "http://x", "--prices", str(prices)])
    assert exc.value.code == 2
    assert "argument --prices: cannot read the price table" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "named"), [
    ("m: {input_per_million: .nan}\n", "input_per_million must be a finite number"),
    ("m: {output_per_million: .inf}\n", "output_per_million must be a finite number"),
    ("m: {input_per_million: true}\n", "input_per_million must be a finite number"),
    ("m: {input_per_million: '0.15'}\n", "input_per_million must be a finite number"),
    ("m: {input: 1}\n", "the price of 'm' must be a mapping with"),
    ("- m\n", "a price table maps model names to prices"),
])
def test_price_table_values_that_are_not_prices_are_refused(
        text: str, named: str, tmp_path: Path) -> None:
    """NaN, infinity and `true` were taken as prices (`sluice gateway --prices` started:
    a NaN cost passes every budget check, `true` was $1); the others failed with
    Python's own words. `--prices` reports the message as its usage error."""
    prices = tmp_path / "prices.yaml"
    prices.write_text(text)
    with pytest.raises(InvalidRequestError, match=named):
        PriceTable.load(prices)
    with pytest.raises(argparse.ArgumentTypeError, match=named):
        price_file(str(prices))


def test_dev_key_is_created_once_and_reused(sqlite_store: SQLStore, tmp_path: Path) -> None:
    path = tmp_path / "home" / "dev-key"
    key = ensure_dev_key(sqlite_store, path)
    assert ensure_dev_key(sqlite_store, path) == key
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    principal = sqlite_store.authenticate(key)
    assert principal is not None and principal.tenant.name == "dev"
    sqlite_store.revoke_key(principal.key.id)  # a dead saved key is replaced
    fresh = ensure_dev_key(sqlite_store, path)
    assert fresh != key and sqlite_store.authenticate(fresh) is not None


def test_a_deleted_dev_tenant_leaves_serve_without_a_dev_key(sqlite_store: SQLStore,
                                                              tmp_path: Path) -> None:
    """Deleting the dev tenant took its key away; `sluice serve` used to fail at start
    ('tenant dev already exists': a deleted tenant's name stays taken). It starts without
    a dev key instead, and mints none (that would undo the deletion)."""
    path = tmp_path / "home" / "dev-key"
    key = ensure_dev_key(sqlite_store, path)
    sqlite_store.delete_tenant("dev")
    assert sqlite_store.authenticate(key) is None
    assert ensure_dev_key(sqlite_store, path) is None
    assert [k for k in sqlite_store.list_keys() if k.revoked_at is None] == []


def test_price_table_file_and_default(tmp_path: Path) -> None:
    f = tmp_path / "prices.yaml"
    f.write_text("gpt-x: {input_per_million: 2.0, output_per_million: 8.0}\n"
                 "'*': {input_per_million: 0.5}\n")
    table = PriceTable.load(f)
    assert table.cost("gpt-x", 1_000_000, 500_000) == pytest.approx(6.0)
    assert table.cost("other", 2_000_000, 10) == pytest.approx(1.0)
    assert PriceTable().cost("SmolLM2-135M-Instruct", 10**6, 10**6) == 0.0


def test_default_redactor() -> None:
    text = ("write to bob.smith@example.com or +1 415-555-0132, card 4111 1111 1111 1111; "
            "order 1234567890123 on 2024-01-05")
    out = default_redactor(text)
    assert "[EMAIL]" in out and "[PHONE]" in out and "[CARD]" in out
    assert "example.com" not in out and "4111" not in out
    assert "1234567890123" in out and "2024-01-05" in out  # not Luhn-valid / not a phone


async def test_gateway_process_over_proxy_streams_and_aborts_upstream(
        sqlite_store: SQLStore) -> None:
    """`sluice gateway --upstream`: gateway + UpstreamProxy in front of a real server."""
    stub = StubUpstream(chunk_delay=0.03, max_reply=50)
    key = new_key(sqlite_store)
    async with serve(stub) as upstream_url:
        gw = GatewayMiddleware(UpstreamProxy(upstream_url), make_state(sqlite_store))
        async with serve(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
            headers = {"Authorization": f"Bearer {key}"}
            r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            assert len(r.headers["x-request-id"]) == 32
            async with c.stream("POST", "/v1/chat/completions", headers=headers,
                                json={**CHAT, "max_tokens": 50, "stream": True}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: {"):
                        break
            for _ in range(100):  # the hang-up reaches the upstream, which stops generating
                if stub.streams_cancelled:
                    break
                await asyncio.sleep(0.02)
            assert stub.streams_cancelled == 1 and stub.streams_finished == 0
            assert (await c.get("/health")).text == "ok"
            await gw.state.aclose()
    records = sqlite_store.query_usage(UsageQuery())
    assert [r.status for r in records] == ["ok", "aborted"]


async def test_proxy_reports_unreachable_upstream_as_502(sqlite_store: SQLStore) -> None:
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(UpstreamProxy("http://127.0.0.1:1"), make_state(sqlite_store))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw),  # type: ignore[arg-type]
                                 base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=CHAT,
                         headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"
    [rec] = sqlite_store.query_usage(UsageQuery())
    assert (rec.status, rec.http_status) == ("error", 502)


async def test_proxy_reports_unreachable_upstream_in_anthropics_shape_on_messages(
        sqlite_store: SQLStore) -> None:
    """The proxy's 502 was OpenAI's error JSON on every path; on /v1/messages the
    Anthropic SDK reads `{"type": "error", "error": {"type", "message"}}`."""
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(UpstreamProxy("http://127.0.0.1:1"), make_state(sqlite_store))
    body = {"model": "stub-model", "max_tokens": 5,
            "messages": [{"role": "user", "content": "Hello"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw),  # type: ignore[arg-type]
                                 base_url="http://gw") as c:
        r = await c.post("/v1/messages", json=body, headers={"x-api-key": key})
    assert r.status_code == 502
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "unreachable" in error["error"]["message"]
