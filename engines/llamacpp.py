"""llama.cpp, built from the source the llama-cpp-python sdist vendors, as a peer engine.

`build()` downloads the sdist with pip (no install), builds llama.cpp's tools with cmake + ninja
once per version into $SPECULATORS_CACHE/llama.cpp/<version>-logjoin (else ~/.cache/speculators-forge/...),
and returns the folder of the binaries. One patch: the logger's thread is joined at exit (LOG_JOIN).
No native build: one crashed on a CPU reporting AMX for every batch of more than one token;
GGML_NATIVE=OFF with AVX2, FMA and F16C runs everywhere here.

`Server` runs llama-server on a loopback port with parallel slots (continuous batching), for
bulk generation (train/regenerate.py's engine=llamacpp).

`speculative_simple` runs llama-speculative-simple (examples/speculative-simple in the source) once
and returns its counters: a drafter exported as GGUF (speculators/formats/gguf.py) served by llama.cpp.
`completion` runs llama-completion the same way without a drafter: llama.cpp's target-only speed (with
special tokens printed, as llama-speculative-simple prints them).
"""

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common.config import UserError
from common.files import cache_root
from engines import Engine, register_engine

VERSION = "0.3.36"  # llama-cpp-python's sdist: vendor/llama.cpp is the source built
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
TOOLS = ("llama-server", "llama-bench", "llama-speculative-simple", "llama-completion")
# AVX-512 (with VNNI) measured no faster on this Q4_1 model (pp128 185 vs 179 tokens/s, tg32 48-50 vs 53, one
# thread, Sapphire Rapids), so one portable build serves every machine here. Static: the tools do not
# depend on the build folder's libraries.
FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release")


# llama.cpp's logger writes from a thread nobody joins at exit (upstream issue 22142): a tool that ends
# quickly on busy cores loses its log's end, the counters parsed here included. The build joins it at exit.
LOG_ANCHOR = "        log = new common_log;\n"
LOG_JOIN = "        std::atexit([] { common_log_pause(log); });  // speculators-forge: flush the log at exit\n"
BUILD = f"{VERSION}-logjoin"  # the cache folder's name: a new one whenever the patch or FLAGS change


def cache_dir() -> Path:
    return cache_root() / "llama.cpp" / BUILD


def build(jobs: int = 2) -> Path:
    """The folder holding llama.cpp's tools, building them on the first call."""
    bin_dir = cache_dir() / "bin"
    if all((bin_dir / tool).is_file() for tool in TOOLS):
        return bin_dir
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise UserError(f"building llama.cpp needs {tool}; install it: pip install {tool} (or apt-get install "
                            f"{'ninja-build' if tool == 'ninja' else tool})")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise UserError("building llama.cpp needs a C++ compiler; install one: apt-get install g++")
    source = unpack_source()
    build_dir = cache_dir() / "build"
    print(f"building llama.cpp {VERSION} ({', '.join(TOOLS)}) in {build_dir}: a few minutes, once", file=sys.stderr)
    run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *FLAGS])
    run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS])
    partial = cache_dir() / "bin.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(build_dir / "bin", partial, symlinks=True)
    os.replace(partial, bin_dir)
    return bin_dir


def unpack_source() -> Path:
    source = cache_dir() / "src"
    if (source / "CMakeLists.txt").is_file():
        return source
    with tempfile.TemporaryDirectory() as tmp:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
             f"llama-cpp-python=={VERSION}"])
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        partial = source.with_name("src.partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.move(str(next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"), partial)
        join_log_at_exit(partial / "common" / "log.cpp")
        os.replace(partial, source)
    return source


def join_log_at_exit(log_source: Path) -> None:
    text = log_source.read_text()
    if LOG_ANCHOR not in text:
        raise UserError(f"{log_source} no longer creates its logger as expected; update LOG_ANCHOR for llama.cpp "
                        f"{VERSION}")
    log_source.write_text(text.replace(LOG_ANCHOR, LOG_ANCHOR + LOG_JOIN, 1))


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise UserError(f"{' '.join(command[:3])} ... failed (exit {done.returncode}): {' | '.join(tail)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child before exec: SIGTERM it when its parent dies (Linux), so a killed regeneration
    does not leave its server running; elsewhere the parent's close() is the only cleanup."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Server:
    """llama-server on 127.0.0.1 serving one GGUF with `slots` parallel sequences of `context` tokens each."""

    def __init__(self, model: Path, slots: int = 8, context: int = 4096, threads: int = 1):
        self.port = free_port()
        command = [str(build() / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                   "-np", str(slots), "-c", str(slots * context), "-t", str(threads), "-tb", str(threads),
                   "--no-webui", "-cb"]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="llama-server-")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise UserError(f"llama-server exited: {' | '.join(self.log.read().strip().splitlines()[-3:])}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise UserError(f"llama-server did not start within {timeout:.0f} s")

    def complete(self, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> dict:
        """One completion of token ids: {"tokens": [...], "stopped_eos": bool}."""
        sampling = ({"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0} if temperature
                    else {"temperature": 0.0, "top_k": 1})
        body = {"prompt": prompt, "n_predict": max_new_tokens, "seed": seed, "cache_prompt": True,
                "return_tokens": True, "samplers": ["top_k", "top_p", "min_p", "temperature"], **sampling}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as r:
            answer = json.load(r)
        return {"tokens": answer["tokens"], "stopped_eos": bool(answer.get("stop_type") == "eos")}

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class SpeculativeRun:
    """llama-speculative-simple's summary of one generation."""

    n_predict: int  # tokens generated
    n_drafted: int  # draft tokens proposed (small drafts it discards are not counted)
    n_accept: int  # draft tokens accepted
    decode_tokens_per_s: float
    prompt_tokens_per_s: float
    text: str  # the prompt and the generated text
    n_drafts: int | None = None  # drafts (verification steps with a draft); None: its statistics line is absent

    @property
    def acceptance(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0


def speculative_simple(target: Path, draft: Path | None, prompt: str, n_predict: int = 32, draft_max: int = 4,
                       spec_type: str = "draft-eagle3", threads: int = 1, context: int = 2048,
                       timeout: float = 600, p_min: float | None = None) -> SpeculativeRun:
    """Greedy speculative generation of `n_predict` tokens after `prompt` with llama.cpp: target GGUF `-m`,
    draft GGUF `-md` (draft-eagle3 or draft-dspark for speculators/formats/gguf.py's files; None for
    ngram-simple). `p_min`: --spec-draft-p-min, which draft-dspark reads as its confidence threshold (0: off)."""
    command = speculative_command(build() / "llama-speculative-simple", target, draft, prompt, n_predict, draft_max,
                                  spec_type, threads, context, p_min)
    done = run_logged(command, "llama-speculative-simple", timeout)
    return parse_speculative(done.stdout, done.stderr)


def speculative_command(tool: Path, target: Path, draft: Path | None, prompt: str, n_predict: int, draft_max: int,
                        spec_type: str, threads: int, context: int, p_min: float | None) -> list[str]:
    """llama-speculative-simple's command line, greedy."""
    # -lv 4 (trace) adds the drafter's statistics line, which counts the drafts; not the per-token debug lines.
    return [str(tool), "-m", str(target), *(["-md", str(draft)] if draft else []),
            "--spec-type", spec_type, "--spec-draft-n-max", str(draft_max),
            *(["--spec-draft-p-min", str(p_min)] if p_min is not None else []),
            "-p", prompt, "-n", str(n_predict), "-c", str(context), "-t", str(threads), "-td", str(threads),
            "--temp", "0", "--seed", "0", "-lv", "4"]


def run_logged(command: list[str], name: str, timeout: float) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool whose figures come from its log (stderr)."""
    # Tokens are printed one by one, so a multi-byte character can be split: replace, not fail.
    done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=timeout)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise UserError(f"{name} failed (exit {done.returncode}): {' | '.join(tail)}")
    return done


def parse_speculative(stdout: str, stderr: str) -> SpeculativeRun:
    """The counters llama-speculative-simple logs at the end (stderr); the text goes to stdout."""
    def number(pattern: str) -> float:
        found = re.search(pattern, stderr)
        if found is None:
            tail = " | ".join(stderr.strip().splitlines()[-2:])
            raise UserError(f"llama-speculative-simple's log has no {pattern!r} (its output format changed?); it "
                            f"ended: {tail}")
        return float(found.group(1))

    speed = r"speed:\s*([\d.]+|inf|nan) t/s"
    return SpeculativeRun(n_predict=int(number(r"n_predict = (\d+)")), n_drafted=int(number(r"n_drafted = (\d+)")),
                          n_accept=int(number(r"n_accept  = (\d+)")),
                          decode_tokens_per_s=number(r"decoded .*" + speed),
                          prompt_tokens_per_s=number(r"encoded .*" + speed), text=stdout.strip(),
                          n_drafts=drafts_made(stderr))


def drafts_made(stderr: str) -> int | None:
    """The drafts the drafter's statistics line counts ("#gen drafts = N", logged at trace level), summed over
    its lines (one per speculative implementation); None where the log has none."""
    found = re.findall(r"#gen drafts =\s*(\d+)", stderr)
    return sum(int(n) for n in found) if found else None


@dataclass
class CompletionRun:
    """llama-completion's summary of one greedy generation."""

    n_predict: int  # tokens decoded after the prompt's pass
    decode_tokens_per_s: float
    text: str


def completion(target: Path, prompt: str, n_predict: int = 32, threads: int = 1, context: int = 2048,
               timeout: float = 600, ubatch: int | None = None) -> CompletionRun:
    """Greedy target-only generation of `n_predict` tokens after `prompt` with llama-completion; `ubatch`:
    the most tokens one pass computes (llama.cpp's -ub; None: its default, the whole prompt in one pass)."""
    command = [str(build() / "llama-completion"), "-m", str(target), "-p", prompt, "-n", str(n_predict),
               "-c", str(context), "-t", str(threads), "--temp", "0", "--seed", "0", "-no-cnv",
               *(["-ub", str(ubatch)] if ubatch else [])]
    decode_line = r"perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs"  # not "prompt eval time"
    done = run_logged(command + ["-sp"], "llama-completion", timeout)
    found = re.search(decode_line, done.stderr)
    if found is None:
        raise UserError("llama-completion's log has no 'eval time = ... runs'; its output format changed?")
    ms, runs = float(found.group(1)), int(found.group(2))
    return CompletionRun(n_predict=runs, decode_tokens_per_s=1000 * runs / ms, text=done.stdout.strip())


register_engine(Engine("llamacpp", "llama.cpp", trained_quant=True))
