"""benchmark/tldr/judge.py against a stand-in OpenAI-compatible server on 127.0.0.1 (no network)."""

import json
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer

import plumbing
from benchmark.tldr import judge
from conftest import LETTERS, REPO, cpu_env, write_jsonl
from helpers import free_port, python  # noqa: F401 (kept importable from here)

JUDGE_MODEL = "stand-in-judge"
SLOTS = re.compile(r"\nSummary A:\n(.*)\n\nSummary B:\n(.*)\n\nFIRST provide", re.DOTALL)


def stand_in_answer(prompt: str) -> str:
    """The stand-in judge's rule: no verdict if a summary says `confuse`; else A if A says `best` or B says `worst`,
    else B. The verdict line alternates between two formats real judges write."""
    summary_a, summary_b = SLOTS.search(prompt).groups()
    if "confuse" in summary_a + summary_b:
        return "Comparison: both are equally good.\nI cannot decide."
    choice = "A" if "best" in summary_a or "worst" in summary_b else "B"
    verdict = f"Preferred: {choice}" if len(prompt) % 2 else f'**Preferred:** "{choice}"'
    return f"Comparison: {choice} is better.\n{verdict}"


class StandIn:
    """POST /v1/chat/completions answered by `stand_in_answer`; the first `fail_first` requests get `fail_status`,
    an unknown model gets 400. Counts the requests and keeps their headers and bodies."""

    def __init__(self):
        self.requests, self.fail_first, self.fail_status = 0, 0, 503
        self.received: list[tuple[dict, dict]] = []
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stand_in.lock:
                    stand_in.requests += 1
                    count = stand_in.requests
                    stand_in.received.append((dict(self.headers), body))
                if self.path != "/v1/chat/completions":
                    self.reply(404, {"error": {"message": f"no route {self.path}"}})
                elif count <= stand_in.fail_first:
                    self.reply(stand_in.fail_status, {"error": {"message": "overloaded, try again"}})
                elif body["model"] != JUDGE_MODEL:
                    self.reply(400, {"error": {"message": f"model {body['model']!r} does not exist"}})
                else:
                    content = stand_in_answer(body["messages"][0]["content"])
                    self.reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})

            def reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture
def stand_in():
    server = StandIn()
    yield server
    server.server.shutdown()
    server.server.server_close()


def client(stand_in: StandIn, cache_path, model: str = JUDGE_MODEL, api_key=None, max_retries: int = 3):
    return judge.JudgeClient(stand_in.base_url, model, api_key, str(cache_path), max_retries, backoff=0.001,
                             timeout=5.0)


# ---------------------------------------------------------------- pure functions
def test_prompt_has_post_and_summaries_in_their_slots():
    post = judge.post_text("SUBREDDIT: r/test\n\nTITLE: a title\n\nPOST: the post body\n\nTL;DR:")
    assert post == "SUBREDDIT: r/test\n\nTITLE: a title\n\nPOST: the post body"
    prompt = judge.judge_prompt(post, "first {summary}", "second one")
    assert prompt.startswith("Which of the following summaries does a better job of summarizing the most important")
    assert f"\n\nPost:\n{post}\n\nSummary A:\nfirst {{summary}}\n\nSummary B:\nsecond one\n\nFIRST provide" in prompt
    assert prompt.endswith('Comparison: <one-sentence comparison and explanation>\nPreferred: <"A" or "B">')
    assert "TL;DR:" not in prompt


@pytest.mark.parametrize("answer, expected", [
    ("Comparison: A is concise.\nPreferred: A", "A"),
    ("Comparison: B keeps the key point.\nPreferred: B\n", "B"),
    ("comparison: x\npreferred: b", "B"),
    ('Comparison: x\n**Preferred:** "A"', "A"),
    ("Comparison: x\nPreferred: <B>.", "B"),
    ("Preferred: A\nOn reflection, B is better.\nPreferred: B", "B"),  # the last verdict counts
    ("Comparison: I prefer A.", None),
    ("Preferred: A or B", None),
    ("Preferred: Answer A", None),
    ("Preferred: C", None),
    ("", None),
])
def test_parse_preference(answer, expected):
    assert judge.parse_preference(answer) == expected


def test_order_is_seeded_and_balanced():
    order = judge.policy_first(4000, seed=0)
    assert order == judge.policy_first(4000, seed=0) and order != judge.policy_first(4000, seed=1)
    assert 0.47 < sum(order) / len(order) < 0.53
    assert judge.policy_first(10, seed=0) == order[:10]  # a longer run keeps the order of the shorter one


def test_outcomes_and_win_rate():
    assert [judge.outcome("A", True), judge.outcome("B", True), judge.outcome("A", False),
            judge.outcome("B", False), judge.outcome(None, True)] == [1.0, 0.0, 0.0, 1.0, 0.5]
    result = judge.win_rate([1.0, 1.0, 1.0, 0.0, 0.5])
    assert result["win_rate"] == pytest.approx(0.7)
    assert (result["wins"], result["losses"], result["ties"], result["num_examples"]) == (3, 1, 1, 5)
    assert result["win_rate_stderr"] == pytest.approx((0.8 / 4 / 5) ** 0.5)  # squared deviations sum to 0.8


# ---------------------------------------------------------------- client
def test_client_retries_503_and_429_then_caches(stand_in, tmp_path):
    prompt = judge.judge_prompt("a post", "a best summary", "another")
    stand_in.fail_first = 2
    first = client(stand_in, tmp_path / "cache.jsonl", api_key="sk-test")
    assert judge.parse_preference(first.complete(prompt)) == "A"
    assert stand_in.requests == first.num_requests == 3
    assert stand_in.received[-1][0]["Authorization"] == "Bearer sk-test"
    assert stand_in.received[-1][1] == {"model": JUDGE_MODEL, "messages": [{"role": "user", "content": prompt}],
                                        "temperature": 0}
    assert first.complete(prompt) == first.complete(prompt) and first.num_cached == 2 and stand_in.requests == 3

    stand_in.fail_first, stand_in.fail_status = 5, 429  # requests 4 and 5 are rate-limited
    other = judge.judge_prompt("a post", "another", "a best summary")
    second = client(stand_in, tmp_path / "cache.jsonl")  # a new process would read the same file
    assert judge.parse_preference(second.complete(other)) == "B" and second.num_requests == 3
    assert "Authorization" not in stand_in.received[-1][0]  # no key: no header
    second.complete(prompt)
    assert second.num_requests == 3 and second.num_cached == 1 and stand_in.requests == 6
    assert len((tmp_path / "cache.jsonl").read_text().splitlines()) == 3  # its signature and two answers


def test_client_fails_at_once_on_4xx_and_after_retries_on_5xx(stand_in, tmp_path):
    with pytest.raises(judge.JudgeError, match="refused the request with HTTP 400: model 'gpt-x' does not exist"):
        client(stand_in, tmp_path / "cache.jsonl", model="gpt-x").complete("prompt")
    assert stand_in.requests == 1
    stand_in.fail_first = 100
    with pytest.raises(judge.JudgeError, match=r"after 3 attempts \(HTTP 503: overloaded, try again\)"):
        client(stand_in, tmp_path / "cache.jsonl", max_retries=2).complete("prompt")
    assert stand_in.requests == 4
    assert not (tmp_path / "cache.jsonl").exists()  # failures are not cached


def test_cache_survives_an_interrupted_write(stand_in, tmp_path):
    cache = tmp_path / "cache.jsonl"
    prompt = judge.judge_prompt("post", "x", "y worst")
    client(stand_in, cache).complete(prompt)
    cache.write_text(cache.read_text() + '{"key": "abc", "mod')  # killed in the middle of a line
    resumed = client(stand_in, cache)
    assert judge.parse_preference(resumed.complete(prompt)) == "A" and resumed.num_requests == 0
    resumed.complete(judge.judge_prompt("post", "x best", "y"))
    assert resumed.num_requests == 1
    assert len(client(stand_in, cache).cache) == 2


# ---------------------------------------------------------------- judge.py end to end
REFERENCES = ["a b worst"] * 5 + ["c best"] * 4 + ["d confuse"] * 3  # 5 wins, 4 losses, 3 unparseable


@pytest.fixture
def tldr_rows() -> list[dict]:
    """Posts of 1-6 letters (varied lengths: batches are padded) ending in `:`, with marked reference summaries."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, reference in enumerate(REFERENCES):
        letters = [LETTERS[j] for j in torch.randperm(len(LETTERS), generator=gen)[: 1 + i % 6].tolist()]
        rows.append({"prompt": " ".join(letters) + " :", "completion": " " + reference, "id": i})
    return rows


def run_judge(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = cpu_env(env)
    return subprocess.run([python(), str(REPO / "benchmark" / "tldr" / "judge.py"), *map(str, args)],
                          capture_output=True, text=True, env=full_env, cwd=REPO, timeout=120)


def greedy_summary(model, tokenizer, prompt: str, response_length: int) -> str:
    """One prompt at a time (no padding) with transformers' own generate: the reference for judge.py's batches."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # (1, Tq)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=response_length, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # (1, Tq + Tr)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_win_rate_end_to_end_with_retries_then_all_from_cache(assets, stand_in, tldr_rows, tmp_path, capsys):
    data = write_jsonl(tmp_path / "tldr.jsonl", tldr_rows)
    output = tmp_path / "eval" / "judge.json"
    command = ("--model_name_or_path", assets["policy"], "--dataset_name", data, "--response_length", 6,
               "--batch_size", 5, "--base_url", stand_in.base_url, "--model", JUDGE_MODEL, "--api_key_env",
               "JUDGE_TEST_KEY", "--seed", 3, "--cache_path", tmp_path / "cache.jsonl", "--output_path", output,
               "--max_retries", 3, "--backoff", 0.01, "--num_workers", 4)
    stand_in.fail_first = 2
    result = run_judge(*command, env={"JUDGE_TEST_KEY": "sk-e2e"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert stand_in.requests == len(REFERENCES) + 2
    assert {headers["Authorization"] for headers, _ in stand_in.received} == {"Bearer sk-e2e"}
    expected = {"win_rate": pytest.approx((5 + 3 / 2) / 12), "num_examples": 12, "wins": 5, "losses": 4, "ties": 3,
                "judge_model": JUDGE_MODEL, "model_name_or_path": str(assets["policy"])}
    saved = json.loads(output.read_text())
    assert {key: saved[key] for key in expected} == expected
    assert "win rate" in result.stdout and "0.542" in result.stdout and "ties 3" in result.stdout

    rows = [json.loads(line) for line in (tmp_path / "eval" / "judge.summaries.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in rows] == [row["prompt"] for row in tldr_rows]
    assert [row["reference"] for row in rows] == REFERENCES
    assert [row["outcome"] for row in rows] == [1.0] * 5 + [0.0] * 4 + [0.5] * 3
    assert [row["policy_is_a"] for row in rows] == judge.policy_first(12, seed=3)
    assert 3 <= sum(row["policy_is_a"] for row in rows) <= 9
    model = AutoModelForCausalLM.from_pretrained(assets["policy"])
    tokenizer = AutoTokenizer.from_pretrained(assets["policy"])
    assert [row["summary"] for row in rows] == [greedy_summary(model, tokenizer, row["prompt"], 6) for row in tldr_rows]
    sent = {body["messages"][0]["content"] for _, body in stand_in.received}
    assert sent == {judge.judge_prompt(row["prompt"], *((row["summary"], row["reference"]) if row["policy_is_a"]
                                                        else (row["reference"], row["summary"]))) for row in rows}

    stand_in.requests = 0
    capsys.readouterr()
    with torch.random.fork_rng():  # judge.py seeds torch; keep this process's RNG as it was
        judge.main(tyro.cli(judge.Args, args=list(map(str, command))))  # in this process: no key, nothing is sent
    assert stand_in.requests == 0
    assert "0 HTTP requests (retries included), 12 answers from the cache" in capsys.readouterr().out
    assert json.loads(output.read_text()) == saved


def test_unreachable_endpoint_is_a_one_line_error(assets, tldr_rows, tmp_path):
    base_url = f"http://127.0.0.1:{free_port()}/v1"
    result = run_judge("--model_name_or_path", assets["policy"], "--dataset_name",
                       write_jsonl(tmp_path / "tldr.jsonl", tldr_rows), "--num_examples", 2, "--response_length", 4,
                       "--base_url", base_url, "--cache_path", tmp_path / "cache.jsonl", "--max_retries", 2,
                       "--backoff", 0.01)  # gives up after its attempts, as the line says, not after seconds
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("judge.py: error: no answer from "), result.stderr
    assert f"{base_url}/chat/completions after 3 attempts" in lines[0] and "--base_url" in lines[0]


def test_bad_dataset_and_model_are_config_errors(assets, tldr_rows, tmp_path):
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"post": r["prompt"], "summary": r["completion"]}
                                                       for r in tldr_rows])
    with pytest.raises(plumbing.ConfigError, match=r"no column 'prompt' or 'completion'.*--prompt_column NAME"):
        judge.main(judge.Args(model_name_or_path=str(assets["policy"]), dataset_name=str(renamed)))
    data = write_jsonl(tmp_path / "tldr.jsonl", tldr_rows)
    with pytest.raises(plumbing.ConfigError, match="could not load tokenizer from"):
        judge.main(judge.Args(model_name_or_path=str(tmp_path / "no_such_model"), dataset_name=str(data)))


def test_trls_judge_tldr_flags_are_taken(tmp_path):
    """TRL's examples/scripts/evals/judge_tldr.py: --model_name_or_path, --judge_model, --num_examples (None: all); a
    Hub judge (TRL asks Hugging Face's inference API) needs a --base_url that serves it: one line, before anything
    loads."""
    args = tyro.cli(judge.Args, args=["--model_name_or_path", "m", "--judge_model", "gpt-3.5-turbo-0125",
                                      "--num_examples", "None"])
    assert (args.model, args.num_examples) == ("gpt-3.5-turbo-0125", None)
    hub = tyro.cli(judge.Args, args=["--model_name_or_path", "m", "--judge_model",
                                     "meta-llama/Meta-Llama-3-70B-Instruct"])
    with pytest.raises(plumbing.ConfigError, match="^--judge_model meta-llama/Meta-Llama-3-70B-Instruct is a Hub "
                                                   "model, which OpenAI's API does not serve: pass --base_url"):
        judge.main(hub)
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)]
    every = tyro.cli(judge.Args, args=["--model_name_or_path", "m", "--dataset_name",
                                       str(write_jsonl(tmp_path / "d.jsonl", rows)), "--num_examples", "None"])
    assert judge.load_examples(every)[1] == ["c0", "c1", "c2"]
