"""What an outside party writes (an engine's or a judge's HTTP body, a reward function's exception, a file's values,
a library's error) reaches the terminal as one line of inert text: terminal escape sequences, carriage returns, NUL,
bidirectional overrides escaped, a 2 MB body or an HTML page cut to one line. Each boundary is fed every hostile
text."""

import json
import threading
import unicodedata
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import plumbing
import rloo
import rloo_multinode as mn
from benchmark.tldr import judge
from conftest import policy_tokenizer, tiny_policy, tiny_reward_model, write_jsonl
from helpers import fake_run

HTML_404 = ("<!DOCTYPE html>\n<html>\n<head><title>404 Not Found</title></head>\n<body>\n<h1>Not Found</h1>\n"
            "<p>The requested URL was not found on this server.</p>\n</body>\n</html>\n")
HOSTILE = {  # name: (text, a visible part that must still be shown)
    "CSI clear screen": ("\x1b[2J\x1b[Hthe server is down", "the server is down"),
    "OSC window title": ("\x1b]0;rloo.py: finished\x07bad gateway", "bad gateway"),
    "a fake saved line": ("failed\r\nrloo.py: saved checkpoint step_9\rrloo.py: done\n", "failed"),
    "bidi override": ("model \u202egnp.exe\u202c is missing", "is missing"),
    "NUL and DEL": ("a\x00b\x7fc\x9bd", "a"),
    "a 2 MB body": ("x" * 2_000_000, "xxxx"),
    "an HTML 404 page": (HTML_404, "404 Not Found"),
}
INVISIBLE = ("Cc", "Cf", "Cs", "Co", "Zl", "Zp")  # what could move the cursor or reorder what is shown


def first_line_part(name: str) -> str:
    """What of a hostile text must still show where only an exception's first line is shown."""
    text, visible = HOSTILE[name]
    return visible if visible in text.strip().splitlines()[0] else ""


def assert_inert(line: str, visible: str = "", limit: int = 2000) -> None:
    """One line, nothing a terminal acts on, of a length a terminal shows."""
    assert len(line) <= limit, len(line)
    bad = sorted({repr(c) for c in line if unicodedata.category(c) in INVISIBLE})
    assert not bad, (bad, line[:200])
    assert visible in line, (visible, line[:300])


@pytest.mark.parametrize("name", HOSTILE)
def test_inert_escapes_every_control_and_format_character_and_cuts_to_one_line(name):
    text, visible = HOSTILE[name]
    shown = plumbing.inert(text)
    assert_inert(shown, visible, limit=plumbing.errors.SHOWN + 40)
    if len(text) > plumbing.errors.SHOWN:
        assert shown.endswith(f"(cut: {len(text)} characters in all)")
    assert plumbing.inert("café 中文 ok") == "café 中文 ok"  # readable text stays as it is


@pytest.mark.parametrize("name", HOSTILE)
def test_an_exceptions_words_are_inert_in_every_one_line_error(name):
    text, _ = HOSTILE[name]
    for line in (plumbing.first_line(RuntimeError(text)), plumbing.describe(ValueError(text))):
        assert_inert(line, first_line_part(name))
    with pytest.raises(plumbing.ConfigError) as refused, plumbing.reading("the input x", "fix it"):
        raise OSError(text)
    assert_inert(str(refused.value), "the input x")


class RawServer:
    """Answers every request with `status` and the raw `body` (as a misbehaving server, a proxy or a hostile one)."""

    def __init__(self):
        self.status, self.body, self.content_type = 500, b"", "text/plain"
        server = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_response(server.status)
                self.send_header("Content-Type", server.content_type)
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                self.wfile.write(server.body)

            do_GET = do_POST = answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture(scope="module")
def raw_server():
    server = RawServer()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.mark.parametrize("status", [404, 500])
@pytest.mark.parametrize("name", HOSTILE)
def test_an_engine_urls_error_body_is_one_inert_line(raw_server, name, status):
    text, visible = HOSTILE[name]
    raw_server.status, raw_server.body, raw_server.content_type = status, text.encode(), "text/html"
    with pytest.raises(mn.EngineError) as failed:
        mn.http_json(f"{raw_server.url}/v1/completions", {"prompt": [[1]]}, 10.0)
    assert_inert(str(failed.value), f"answered {status}: ")
    assert visible.splitlines()[0][:20] in str(failed.value)


MODELS = {"data": [{"id": "m"}]}
SERVER_INFO = {"vllm_config": {"weight_transfer_config": {"backend": "gloo"},
                               "model_config": {"logprobs_mode": "processed_logprobs", "max_model_len": 4096}}}


@pytest.mark.parametrize("answer,step", [
    (["a list"], "attach"), ({"data": []}, "attach"),
    ({**MODELS, "vllm_config": {"model_config": {"max_model_len": "\x1b[2J"}}}, "check"),
    ({**MODELS, "vllm_config": {"weight_transfer_config": {"backend": "\x1b]0;x\x07nccl"}}}, "check"),
    ({**MODELS, **SERVER_INFO, "choices": 3}, "receive"),
    ({**MODELS, **SERVER_INFO, "choices": [{"index": 0, "token_ids": ["\x1b[2J"]}]}, "receive"),
])
def test_an_engine_answer_of_another_shape_is_one_inert_line_naming_the_server(raw_server, answer, step):
    """The trainer's reads of a `vllm serve` answer (its model, its configuration, completions) against a server
    that answers every route with the same JSON."""
    raw_server.status, raw_server.body = 200, json.dumps(answer).encode()
    raw_server.content_type = "application/json"
    args = mn.Args(model_name_or_path="m", engine_urls=raw_server.url, engine_timeout=10.0, response_length=4,
                   max_prompt_length=8)
    with pytest.raises(mn.EngineError, match=rf"vLLM server {raw_server.url}") as failed:
        servers = mn.VLLMServers(args, plumbing.Dist(0, 0, 1, torch.device("cpu")))
        try:
            servers.check_server(raw_server.url, "gloo")
            queries = torch.ones(1, 2, dtype=torch.long)
            servers.send(0, [{"queries": queries, "query_mask": queries.bool(), "k": 1, "stop_token_id": None,
                              "pad_token_id": 0, **mn.sampling_request(mn.rloo.SamplingSettings.of(args), args)}])
            mn.answered(servers.receive(0)[0], mn.Asked(f"vLLM server {raw_server.url}", 1, 4), 16, None, 0)
        finally:
            servers.close()
    assert_inert(str(failed.value))
    assert step != "attach" or "answered in another shape" in str(failed.value)


@pytest.mark.parametrize("name", HOSTILE)
def test_a_judge_endpoints_error_body_and_bad_answer_are_one_inert_line(raw_server, tmp_path, name):
    text, visible = HOSTILE[name]
    client = judge.JudgeClient(f"{raw_server.url}/v1", "m", None, str(tmp_path / "cache.jsonl"), 0, 0.0, 10.0)
    raw_server.status, raw_server.body = 400, text.encode()
    with pytest.raises(judge.JudgeError, match="refused the request with HTTP 400") as refused:
        client.complete("prompt")
    assert_inert(str(refused.value), visible.splitlines()[0][:20])
    raw_server.status = 200  # a 200 whose body is not the API's
    with pytest.raises(judge.JudgeError, match="answered without choices") as refused:
        client.complete("prompt")
    assert_inert(str(refused.value), visible.splitlines()[0][:20])


@pytest.mark.parametrize("name", HOSTILE)
def test_a_reward_functions_exception_is_one_inert_line(name):
    text, _ = HOSTILE[name]

    def shouting(**kwargs):
        raise ValueError(text)

    with pytest.raises(plumbing.RewardFunctionError, match="reward function 'shouting' raised ValueError") as failed:
        plumbing.call_reward_function("shouting", shouting, 2, 10.0, completions=["a", "b"])
    assert_inert(str(failed.value), first_line_part(name))


def test_a_datasets_values_a_models_config_and_a_loaders_error_are_inert(tmp_path):
    hostile = HOSTILE["OSC window title"][0] + HOSTILE["bidi override"][0]
    rows = {"prompt": [{"x": hostile}]}  # neither a string nor chat messages
    with pytest.raises(plumbing.ConfigError, match="row 7: column 'prompt' holds") as refused:
        plumbing.check_prompt_values(rows, [7], "prompt", "data.jsonl")
    assert_inert(str(refused.value))
    model = tiny_reward_model(len(policy_tokenizer()))  # a config naming a causal LM with escapes in its class name
    model.config.architectures = [f"Evil{hostile}ForCausalLM"]
    model.config.save_pretrained(tmp_path / "reward_model")
    with pytest.raises(plumbing.ConfigError, match="not a reward model") as refused:
        plumbing.check_reward_model_config(str(tmp_path / "reward_model"), False)
    assert_inert(str(refused.value))
    (tmp_path / "policy").mkdir()  # transformers' own error quotes the file's model_type
    (tmp_path / "policy" / "config.json").write_text(json.dumps({"model_type": hostile}))
    with pytest.raises(plumbing.ConfigError, match="could not load policy") as refused:
        plumbing.load_config(str(tmp_path / "policy"), "policy", False)
    assert_inert(str(refused.value))


def test_a_run_whose_reward_function_raises_escapes_says_one_inert_line(tmp_path, capfd, monkeypatch):
    """A whole run (in this process): what reaches stderr when a reward function's message holds a whole attack."""
    tokenizer = policy_tokenizer()
    tiny_policy(len(tokenizer)).save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a b :"}] * 8)
    attack = "".join(text for name, (text, _) in HOSTILE.items() if name != "a 2 MB body")
    (tmp_path / "hostile_reward.py").write_text(f"def score(**kwargs):\n    raise RuntimeError({attack!r})\n")
    monkeypatch.syspath_prepend(tmp_path)
    argv = ["--model_name_or_path", tmp_path / "policy", "--dataset_name", tmp_path / "train.jsonl", "--reward_fn",
            "hostile_reward:score", "--output_dir", tmp_path / "out", "--total_episodes", 8,
            "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 1, "--rloo_k", 2,
            "--response_length", 4, "--max_prompt_length", 8, "--num_sample_generations", 0]
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_status:
        plumbing.run_script(rloo.main, plumbing.parse_args(rloo.Args, [str(a) for a in argv]), "rloo.py")
    out, err = capfd.readouterr()
    assert exit_status.value.code == 4, err[-3000:]
    assert_inert(err.strip(), "rloo.py: error: reward function 'score' raised RuntimeError")
    assert "\x1b" not in out + err and "\r" not in err


def test_the_sample_table_shows_prompts_and_completions_as_inert_text_never_as_markup(tmp_path, capsys):
    """A prompt (a file's words) or a completion (a tokenizer's) holding rich's markup (`[/]` crashed the run) or a
    terminal escape."""
    logger = plumbing.RunLogger(rloo.Args(output_dir=str(tmp_path)), "run", 2, 0, None)
    try:
        logger.sample_table([("what does [/] or [bold]x[/bold] mean?", HOSTILE["CSI clear screen"][0] +
                              HOSTILE["a fake saved line"][0], 0.5)], episode=8)
        logger.console.print(f"a note naming {tmp_path / '[/]'}")  # a path, a run name: text too
    finally:
        logger.close()
    out = capsys.readouterr().out
    assert "[/] or [bold]x[/bold]" in out and out.strip().endswith("[/]"), out
    assert "\x1b" not in out and "\r" not in out and "\\x1b[2J\\x1b[Hthe server is" in out, out


def test_a_path_holding_escapes_is_inert_in_every_message_that_shows_it(tmp_path, capsys):
    """Issue 47: ESC and RLO characters in a path reached the terminal raw. Each message is printed at one boundary
    (run_script's error line, the run's notes: plumbing.shown), whatever formatted the path."""
    out = tmp_path / "out\x1b[2J\u202egnp.exe\nrloo.py: done"
    out.mkdir()
    fake_run(out, [1])
    (out / "curves.png").write_text("mine")
    refusals = [  # (what is run, an args object with output_dir for run_script)
        lambda: plumbing.resume_checkpoint(rloo.Args(output_dir=str(out))),  # another run's files
        lambda: plumbing.take_output_dir(plumbing.OutputDirLock(str(out)), 0, {}),  # a foreign curves.png
        lambda: plumbing.check_outputs([("--png-path", out / "args.json")], [], "x.py"),
        lambda: plumbing.check_new_output_dir(str(out), {}),
        lambda: plumbing.check_no_input_inside(str(out), {"model_name_or_path": (str(out), out)}),
    ]
    for refused in refusals:
        with pytest.raises(SystemExit):
            plumbing.run_script(lambda _: refused(), rloo.Args(output_dir=str(out)), "rloo.py")
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "\x1b" not in err and "\u202e" not in err, repr(err)
        assert "out\\x1b[2J\\u202egnp.exe rloo.py: done" in err, repr(err)
    for error in (plumbing.NonFiniteError("loss", [0]), plumbing.Fault(f"could not write {out}")):
        with pytest.raises(SystemExit):
            plumbing.run_script(lambda _: (_ for _ in ()).throw(error), rloo.Args(output_dir=str(out)), "rloo.py")
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "\x1b" not in err and "\u202e" not in err, repr(err)
    logger = object.__new__(plumbing.RunLogger)
    from rich.console import Console

    logger.console = Console(markup=False, force_terminal=False)
    logger.say(f"saved the policy and tokenizer to {out}")
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "\u202e" not in printed and printed.count("\n") == 1, repr(printed)
