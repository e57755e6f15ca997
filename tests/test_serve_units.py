"""The server's parts without a server: keys file, request checks, streamed text and stop strings, CLI."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("starlette")

from serve.__main__ import parse_args  # noqa: E402
from serve.engines import EngineUnavailable, load_engine  # noqa: E402
from serve.keys import KeysError, KeyTable  # noqa: E402
from serve.protocol import ApiError, parse_chat, parse_completion  # noqa: E402
from serve.textstream import TextStream  # noqa: E402
from tests.smollm import smollm2_tokenizer  # noqa: E402

KEYS = """
[plans]
paid = 4
free = 1

[keys]
"sk-acme-1" = { tenant = "acme", plan = "paid" }
"sk-acme-2" = { tenant = "acme", plan = "paid" }
"sk-bob-1" = { tenant = "bob", plan = "free" }
"""


def test_keys_file_maps_keys_to_tenants_and_plans(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    table = KeyTable.load(path)
    assert len(table) == 3
    assert table.lookup("sk-acme-2").tenant == "acme" and table.lookup("sk-bob-1").plan == "free"
    assert table.lookup("sk-acme-") is None and table.lookup("") is None
    assert table.tenants.weight("acme") == 4.0 and table.tenants.weight("bob") == 1.0


@pytest.mark.parametrize("text, match", [
    ("[keys\n", "not valid TOML"),
    ("[plans]\npaid = 1\n", r"\[keys\] table"),
    ('[keys]\n"k1234567890" = { tenant = "a", plan = "gold" }\n', "unknown plan 'gold'"),
    ('[keys]\n"k1" = { tenant = "a", plan = "paid" }\n"k2" = { tenant = "a", plan = "free" }\n', "under another key"),
    ('[keys]\n"k1" = { tenant = "", plan = "paid" }\n', "tenant"),
    ('[keys]\n"k1" = "acme"\n', "must be"),
    ('[plans]\npaid = -1\n[keys]\n"k1" = { tenant = "a", plan = "paid" }\n', "weight"),
    ('[keyz]\n', "unknown table"),
])
def test_bad_keys_files_are_named(tmp_path, text, match):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(KeysError, match=match):
        KeyTable.load(path)
    with pytest.raises(KeysError, match="cannot read"):
        KeyTable.load(tmp_path / "missing.toml")


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0),
    ("max_tokens", 2.5), ("seed", -1), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]), ("n", 0),
    ("stream", "yes"), ("logprobs", 2), ("presence_penalty", 2.5), ("top_k", -2), ("n", 17),
    ("top_logprobs", 21), ("frequency_penalty", "x"), ("min_p", 1.5), ("repetition_penalty", 0),
    ("logit_bias", {"a": 1}), ("logit_bias", {"5": 101}), ("best_of", 0), ("response_format", {"type": "xml"}),
    ("tools", [{"type": "function"}]), ("tool_choice", "required"), ("echo", True),
])
def test_invalid_parameters_name_the_field(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ApiError) as e:
        parse_chat(body, "m")
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


def test_prompt_and_messages_checks():
    for body, param in [({"model": "m"}, "prompt"), ({"model": "m", "prompt": ["a", ""]}, "prompt[1]"),
                        ({"model": "m", "prompt": [1, True]}, "prompt"), ({"prompt": "x"}, "model")]:
        with pytest.raises(ApiError) as e:
            parse_completion(body, "m")
        assert e.value.param == param
    with pytest.raises(ApiError) as e:
        parse_chat({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "m")
    assert e.value.param == "messages[0].role"
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "other", "prompt": "x"}, "m")
    assert e.value.status == 404
    ok = parse_completion({"model": "m", "prompt": [[1, 2, 3]], "stop": "\n", "seed": 3, "top_k": -1}, "m")
    assert ok.prompt == [1, 2, 3] and ok.stop == ["\n"] and ok.max_tokens == 16 and "top_k" not in ok.params
    chat = parse_chat({"model": "m", "max_completion_tokens": 7,
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "m")
    assert chat.max_tokens == 7 and chat.prompt == [{"role": "user", "content": "hi"}]


def _pieces(ids: list[int], stop: list[str]) -> tuple[str, bool]:
    ts = TextStream(smollm2_tokenizer(), stop)
    out = []
    for t in ids:
        out.append(ts.push(t))
        if ts.stopped:
            break
    out.append(ts.finish())
    return "".join(out), ts.stopped


# real tokens: words, a newline, digits, the three byte tokens of an emoji (any order), special tokens
TOKENS = st.sampled_from([19556, 905, 198, 33, 34, 38634, 83, 1939, 2756, 10813, 242, 218, 2, 1, 46494])


@given(st.lists(TOKENS, max_size=14))
def test_streamed_text_equals_the_whole_decode(ids):
    text, stopped = _pieces(ids, [])
    assert text == smollm2_tokenizer().decode(ids, skip_special=True) and not stopped


@given(st.lists(TOKENS, max_size=14), st.integers(0, 40), st.integers(1, 4))
def test_text_ends_before_the_first_stop_string(ids, start, length):
    full = smollm2_tokenizer().decode(ids, skip_special=True)
    stop = full[start:start + length] or "zz"
    if "\ufffd" in stop:
        return
    text, stopped = _pieces(ids, [stop])
    cut = full.find(stop)
    assert (text, stopped) == ((full[:cut], True) if cut >= 0 else (full, False))


def test_multibyte_characters_are_never_split():
    tok = smollm2_tokenizer()
    ids = tok.encode("café 😀 naïve")
    ts = TextStream(tok)
    pieces = [ts.push(t) for t in ids] + [ts.finish()]
    assert "".join(pieces) == "café 😀 naïve" and not any("\ufffd" in p for p in pieces)


def test_cli_refuses_a_public_address_without_keys(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--host", "0.0.0.0"])
    assert "--api-keys" in capsys.readouterr().err
    assert parse_args(["--host", "0.0.0.0", "--allow-unauthenticated"]).host == "0.0.0.0"
    with pytest.raises(SystemExit):
        parse_args(["--num-blocks", "0"])


def test_cli_step_budget_options(capsys):
    args = parse_args(["--max-num-batched-tokens", "2048", "--max-prefill-tokens-with-decodes", "256",
                       "--threads", "1"])
    assert (args.max_num_batched_tokens, args.max_prefill_tokens_with_decodes, args.threads) == (2048, 256, 1)
    default = parse_args([])  # the pair bench_serve_vllm chose; a budget of one's own gets no cap
    d = default
    assert (d.max_num_batched_tokens, d.max_prefill_tokens_with_decodes, d.threads) == (2048, 256, None)
    assert parse_args(["--max-num-batched-tokens", "512"]).max_prefill_tokens_with_decodes is None
    assert (parse_args(["--pipeline", "2"]).max_num_batched_tokens,
            parse_args(["--pipeline", "2"]).max_prefill_tokens_with_decodes) == (256, None)
    assert parse_args([]).decode_stall_budget is None  # measured, not (yet) the default: serve/README.md
    stall = parse_args(["--decode-stall-budget", "512"])  # given alone: the default budget and cap stay
    assert (stall.max_num_batched_tokens, stall.max_prefill_tokens_with_decodes, stall.decode_stall_budget) == (
        2048, 256, 512)
    for bad in (["--max-prefill-tokens-with-decodes", "0"], ["--threads", "0"], ["--decode-stall-budget", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert "must be >= 1" in capsys.readouterr().err


def test_fast_engine_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fast.engine", None)  # import fails as if it were not there
    with pytest.raises(EngineUnavailable, match="fast.engine"):
        load_engine("smollm2", "fast")
    with pytest.raises(EngineUnavailable, match="unknown engine"):
        load_engine("smollm2", "turbo")


def test_latency_summary_and_goodput():
    from serve.latency import RequestRecord, summarize

    fast = RequestRecord(ok=True, output_tokens=5, ttft=0.1, itl=[0.05] * 4, e2e=0.3)
    slow = RequestRecord(ok=True, output_tokens=3, ttft=2.0, itl=[0.5, 0.5], e2e=3.0)
    failed = RequestRecord(error="HTTP 503: busy")
    s = summarize([fast, slow, failed], duration_s=4.0, slo_ttft_ms=500, slo_tpot_ms=100)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 8)
    assert s["goodput_rps"] == 0.25 and s["request_throughput_rps"] == 0.5 and s["slo"]["met"] == 1
    assert abs(fast.tpot - 0.05) < 1e-12 and s["tpot_ms"]["p50"] == 275.0 and s["errors"] == ["HTTP 503: busy"]
    assert summarize([failed], 1.0)["ttft_ms"]["p50"] is None


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    from serve.bench import arrival_times, base_url

    a = arrival_times(2000, 4.0, False, seed=1)
    assert a == arrival_times(2000, 4.0, False, seed=1) and a[0] == 0 and all(np_ >= 0 for np_ in a)
    assert abs(len(a) / a[-1] - 4.0) < 0.4
    assert arrival_times(3, 4.0, True, 0) == [0.0] * 3
    assert base_url("http://h:1/") == "http://h:1/v1" and base_url("http://h:1/v1") == "http://h:1/v1"


def test_paper_gets_the_serving_section_from_its_json(tmp_path):
    import json

    from experiments import report

    side = {"output_throughput_tok_s": 12.5, "ttft_ms.p50": 100.0, "ttft_ms.p90": 200.0, "itl_ms.p50": 50.0,
            "itl_ms.p90": 60.0, "e2e_ms.p50": 900.0}
    record = {"median": {"in_process": side, "served": {**side, "output_throughput_tok_s": 11.25}},
              "setup": {"workload": {"num_prompts": 4, "max_tokens": 8}, "repeats": 2, "commit": "abc"}}
    (tmp_path / "serve_overhead.json").write_text(json.dumps(record))
    text = report.build_paper({}, results_dir=tmp_path, out=tmp_path / "report.md").read_text()
    assert "## Serving: the HTTP layer's overhead" in text and "| served | 11.2 |" in text and "commit abc" in text
    (tmp_path / "serve_overhead.json").write_text("{broken")
    assert "Serving" not in report.build_paper({}, results_dir=tmp_path, out=tmp_path / "r2.md").read_text()
