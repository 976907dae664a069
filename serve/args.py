"""``jaxllm serve`` flags, spelled and defaulted as ``vllm serve``'s, mapped onto
:class:`~jaxllm.engine.engine_config.EngineConfig` (engine) and :class:`ServerConfig` (HTTP
front end).

Values jaxllm cannot honour yet (``--quantization bitsandbytes`` ...)
fail here, before anything is loaded, with a message that says what is supported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from jaxllm.serve import security

from jaxllm.attention import ATTENTION_BACKENDS
from jaxllm.engine.engine_config import BLOCK_SIZES, KV_CACHE_DTYPES, EngineConfig
from jaxllm.engine.replica_devices import visible_gpus
from jaxllm.pooling_params import PoolingParams
from jaxllm.quantization import QUANTIZATION_NAMES

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # TGI's payload limit; aiohttp's own default is 1 MiB
API_KEY_ENV = "JAXLLM_API_KEY"
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
CHAT_TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
MEMORY_MONITOR_ENV = "JAXLLM_MEMORY_MONITOR"
# vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: stay up (health 503) instead of exiting 1.
KEEP_ALIVE_ENV = "JAXLLM_KEEP_ALIVE_ON_ENGINE_DEATH"
# vLLM's VLLM_ENABLE_V1_MULTIPROCESSING: 0 runs the engine on a thread of the server process.
MULTIPROCESSING_ENV = "JAXLLM_ENABLE_MULTIPROCESSING"
MEMORY_MONITOR_INTERVAL_ENV = "JAXLLM_MEMORY_MONITOR_INTERVAL"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end's settings (the engine's are in EngineConfig)."""

    host: str | None = None  # None: every interface (as vLLM)
    port: int = 8000
    served_model_name: tuple[str, ...] = ()  # () = the model's name; the first one is reported
    api_key: str | None = None
    max_queue_len: int | None = None  # requests accepted but not yet generating; None = no cap
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    request_body_timeout: float = 30.0  # seconds a request's body may take to arrive (408)
    # Seconds a stream's client may read nothing (our buffer full) before it counts as gone.
    stream_stall_timeout: float = 60.0
    disable_log_stats: bool = False
    disable_log_requests: bool = False  # no access log line per request
    enable_log_requests: bool = False  # log each request's prompt and parameters
    max_log_len: int | None = None  # characters (or token ids) of a prompt logged; None: all
    stats_interval: float = 5.0  # seconds between stats log lines (vLLM: 5)
    memory_monitor: bool = False
    memory_monitor_interval: float = 10.0
    # Chat: a Jinja template replacing the tokenizer's (the text, read from --chat-template).
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # "hermes" | "llama3_json"
    # /v1/embeddings: how a prompt's hidden states become its embedding (--pooler-config).
    pooler_config: PoolingParams = PoolingParams()
    # HTTPS and CORS (serve/security.py).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE
    allowed_origins: tuple[str, ...] = ()  # () = CORS off
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # False (vLLM's behaviour): when the engine dies the server stops and exits 1.
    keep_alive_on_engine_death: bool = False
    # The engine in its own process (the default, as vLLM's V1), served by this many HTTP
    # front-end processes; False: the engine on a thread of the one server process.
    engine_process: bool = True
    api_server_count: int = 1
    # Engine-core processes, each a whole replica of the model over its own devices (on GPU:
    # tensor_parallel_size each), every front end balancing requests over them all.
    data_parallel_size: int = 1
    # --headless: a multi-host worker node (--node-rank > 0): the worker loop, no API server.
    headless: bool = False

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(0 <= self.port <= 65535, f"port={self.port} must be in [0, 65535]")
        need(self.max_queue_len is None or self.max_queue_len >= 1,
             f"max_queue_len={self.max_queue_len} must be >= 1")
        need(self.max_request_body_bytes >= 1024,
             f"max_request_body_bytes={self.max_request_body_bytes} must be >= 1024")
        need(self.shutdown_timeout >= 0,
             f"shutdown_timeout={self.shutdown_timeout} must be >= 0 seconds")
        need(self.request_body_timeout > 0,
             f"--request-body-timeout={self.request_body_timeout} must be > 0 seconds")
        need(self.stats_interval > 0, f"stats_interval={self.stats_interval} must be > 0")
        need(self.max_log_len is None or self.max_log_len >= 0,
             f"--max-log-len={self.max_log_len} must be >= 0")
        need(self.memory_monitor_interval > 0,
             f"memory_monitor_interval={self.memory_monitor_interval} must be > 0")
        need(self.api_key is None or len(self.api_key) > 0, "api_key must not be empty")
        need(not self.enable_auto_tool_choice or self.tool_call_parser is not None,
             "--enable-auto-tool-choice needs --tool-call-parser")
        need(self.tool_call_parser in (None, *TOOL_CALL_PARSERS),
             f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
             f"{self.tool_call_parser!r}")
        need(self.api_server_count >= 1,
             f"--api-server-count={self.api_server_count} must be >= 1")
        need(self.engine_process or self.api_server_count == 1,
             f"--api-server-count={self.api_server_count} needs the engine in its own process "
             f"(unset {MULTIPROCESSING_ENV}=0)")
        need(self.data_parallel_size >= 1,
             f"--data-parallel-size={self.data_parallel_size} must be >= 1")
        need(self.engine_process or self.data_parallel_size == 1,
             f"--data-parallel-size={self.data_parallel_size} needs the engine in its own "
             f"process (unset {MULTIPROCESSING_ENV}=0)")
        security.check_tls_files(self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_certs,
                                 self.ssl_cert_reqs)


def build_parser(prog: str = "jaxllm serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Serve a model behind an OpenAI-compatible HTTP API "
                               "(/v1/completions, /v1/chat/completions, /metrics ...).")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face model directory or .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="same as MODEL")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer replacing the model's: a Hugging Face directory, a "
                        "tokenizer.json or a .gguf file (e.g. for --load-format dummy)")
    front = p.add_argument_group("server")
    front.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    front.add_argument("--port", type=int, default=8000)
    front.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use in 'model'; the first is reported")
    front.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /v1 and tokenize routes "
                            f"(also from ${API_KEY_ENV})")
    front.add_argument("--max-queue-len", type=int, default=None,
                       help="requests waiting to start before new ones get 429 (default: "
                            "unbounded, as vLLM)")
    front.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="larger request bodies get 413")
    front.add_argument("--request-body-timeout", type=float, default=30.0,
                       help="seconds a request's body may take to arrive before a 408 (a "
                            "client that sends it slowly holds a connection no longer)")
    front.add_argument("--api-server-count", type=int, default=1,
                       help="HTTP front-end processes (tokenizing, rendering and streaming) "
                            "sharing the port, each talking to the one engine-core process")
    front.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may run after SIGTERM before they "
                            "are aborted")
    front.add_argument("--chat-template", default=None,
                       help="a Jinja chat template (a file, the template itself, or a bundled "
                            f"one: {', '.join(bundled_chat_templates())}) instead of the "
                            "tokenizer's")
    front.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto")')
    front.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how tool calls are read from the model's output text")
    front.add_argument("--pooler-config", default=None, type=parse_pooler_config,
                       metavar="JSON",
                       help='/v1/embeddings pooling, e.g. \'{"pooling_type": "MEAN", '
                            '"normalize": true}\' (default: LAST, normalized)')
    security.add_args(front)
    front.add_argument("--disable-log-stats", action="store_true")
    front.add_argument("--disable-log-requests", action="store_true",
                       help="no access log line per request")
    front.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's prompt and sampling parameters (off: no "
                            "request content is ever logged)")
    front.add_argument("--max-log-len", type=int, default=None,
                       help="with --enable-log-requests: log at most this many characters "
                            "(or token ids) of each prompt")
    engine = p.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    engine.add_argument("--load-format", default="auto",
                        choices=["auto", "safetensors", "gguf", "dummy", "orbax"])
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--block-size", type=int, default=16, choices=list(BLOCK_SIZES))
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences per step (default: 1024 on GPUs of >= 70 GiB other "
                        "than A100, 256 on other GPUs, 32 on CPU)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step (default: 8192 on GPUs of >= 70 GiB other than "
                        "A100, 2048 on other GPUs, 512 on CPU)")
    engine.add_argument("--max-model-len", "--max-seq-len", dest="max_model_len", type=int,
                        default=None, help="context length (default: the model's)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--swap-space", type=float, default=4.0,
                        help="GiB of host memory for swapped-out KV blocks")
    engine.add_argument("--cpu-kv-cache-space", type=float, default=4.0,
                        help="GiB for the KV pool when running on CPU")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None)
    engine.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="unrolled layer stack over a per-layer KV pool (default: on GPU, "
                        "where a looped stack's launch blocks the host; off elsewhere)")
    engine.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="auto: pallas_mosaic on a Hopper GPU, pallas on another GPU, the "
                        "XLA reference elsewhere; pallas: the Pallas (Triton) kernels; "
                        "pallas_mosaic: the Hopper prefill kernel (Mosaic GPU) in place of the "
                        "Triton one (needs compute capability 9.0)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="compile step shapes on first use instead of warming them all up")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=False)
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"])
    engine.add_argument("--quantization", "-q", default=None,
                        help="int8 (weight-only) or fp8 (W8A8, dynamic per-token activation "
                        "scales), quantized at load time; awq or gptq (or vLLM's awq_marlin, "
                        "gptq_marlin): a 4-bit checkpoint's own; compressed-tensors: an FP8 "
                        "checkpoint's own; 'gguf' for a .gguf model (dequantized at load); "
                        "None: as the checkpoint is")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="the KV cache's dtype: auto (the model's) or fp8 (e4m3 with a "
                        "scale of 1, as vLLM without calibrated scales: twice the blocks)")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="shard the model over this many local devices (attention heads, "
                        "MLP and vocabulary split; the KV cache split by KV head)")
    engine.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="split the layers into this many stages, each over its own "
                        "tensor-parallel-size devices (tp x pp devices in all; the KV cache "
                        "split by layer with the stages; the layers must divide evenly)")
    engine.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine-core processes, each a replica of the model over its own "
                        "tensor-parallel-size devices; requests go to the least loaded one, or "
                        "to the one that served their prompt's prefix")
    nodes = p.add_argument_group(
        "multi-node", "one model over the devices of several hosts (jax.distributed): run the "
        "same command on each, with its --node-rank, and --headless on all but node 0. "
        "Without the flags, LeaderWorkerSet's LWS_GROUP_SIZE, LWS_WORKER_INDEX and "
        "LWS_LEADER_ADDRESS are read")
    nodes.add_argument("--nnodes", type=int, default=None,
                       help="hosts the model spans, one process each; --tensor-parallel-size "
                       "x --pipeline-parallel-size must equal all their devices (default: "
                       "$LWS_GROUP_SIZE, else 1)")
    nodes.add_argument("--node-rank", type=int, default=None,
                       help="this host's rank: 0 schedules and serves, the others replay its "
                       "steps (default: $LWS_WORKER_INDEX, else 0)")
    nodes.add_argument("--master-addr", default=None,
                       help="node 0's address, where the JAX coordinator runs (default: "
                       "$LWS_LEADER_ADDRESS, else 127.0.0.1)")
    nodes.add_argument("--master-port", type=int, default=29501,
                       help="the JAX coordinator's port on node 0; node 0's step channel to "
                       "the workers listens on the next port")
    nodes.add_argument("--headless", action="store_true",
                       help="run no API server: a worker node's loop (--node-rank > 0)")
    return p


def node_flags(args: argparse.Namespace, environ: dict) -> dict:
    """nnodes, node_rank, master_addr and master_port from the flags, else from the
    environment a LeaderWorkerSet gives every pod (size, index, leader's address), else one
    node. Raises ValueError naming the flag or variable."""
    def from_env(flag: str, value, var: str, default):
        if value is not None or var not in environ:
            return default if value is None else value
        if default is None or isinstance(default, str):
            return environ[var]
        try:
            return int(environ[var])
        except ValueError:
            raise ValueError(f"{var}={environ[var]!r} (read for {flag}) must be an "
                             "integer") from None

    nodes = dict(nnodes=from_env("--nnodes", args.nnodes, "LWS_GROUP_SIZE", 1),
                 node_rank=from_env("--node-rank", args.node_rank, "LWS_WORKER_INDEX", 0),
                 master_addr=from_env("--master-addr", args.master_addr,
                                      "LWS_LEADER_ADDRESS", "127.0.0.1"),
                 master_port=args.master_port)
    if nodes["nnodes"] < 1:
        raise ValueError(f"--nnodes={nodes['nnodes']} must be >= 1")
    if not 0 <= nodes["node_rank"] < nodes["nnodes"]:
        raise ValueError(f"--node-rank={nodes['node_rank']} must be in [0, --nnodes="
                         f"{nodes['nnodes']})")
    if args.headless and nodes["node_rank"] == 0:
        raise ValueError("--headless runs a worker node (--node-rank > 0); node 0 runs the "
                         "API server")
    if nodes["node_rank"] > 0 and not args.headless:
        raise ValueError(f"--node-rank={nodes['node_rank']}: nodes other than 0 run no API "
                         "server; add --headless")
    if nodes["nnodes"] > 1 and args.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size={args.data_parallel_size} with --nnodes="
                         f"{nodes['nnodes']} is not supported: run one multi-node group per "
                         "replica (e.g. a LeaderWorkerSet's replicas)")
    return nodes


def configs_from_args(args: argparse.Namespace,
                      environ: dict | None = None) -> tuple[EngineConfig, ServerConfig]:
    """Both configs from parsed flags; raises ValueError for values jaxllm cannot serve."""
    environ = os.environ if environ is None else environ
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    quantization = args.quantization
    if quantization == "gguf":
        is_gguf = model is None or model.endswith(".gguf") or args.load_format == "gguf"
        if not is_gguf:
            raise ValueError("--quantization=gguf is not supported for this model: it names a "
                             "GGUF file's own quantization (dequantized at load)")
        quantization = None
    elif quantization is not None and quantization not in QUANTIZATION_NAMES:
        raise ValueError(
            f"--quantization={quantization} is not supported yet: jaxllm quantizes weights "
            "with int8 or fp8 at load time and reads 4-bit awq and gptq (also named "
            "awq_marlin, gptq_marlin) and compressed-tensors fp8 checkpoints")
    engine = EngineConfig(
        model=model, tokenizer=args.tokenizer, dtype=args.dtype, load_format=args.load_format,
        seed=args.seed, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, swap_space=args.swap_space,
        cpu_kv_cache_space=args.cpu_kv_cache_space,
        num_gpu_blocks_override=args.num_gpu_blocks_override, enforce_eager=args.enforce_eager,
        unroll_layers=args.unroll_layers, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        quantization=quantization, kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, preemption_mode=args.preemption_mode,
        attention_backend=args.attention_backend, disable_log_stats=args.disable_log_stats,
        **node_flags(args, environ))
    server = ServerConfig(
        host=args.host, port=args.port,
        served_model_name=tuple(args.served_model_name or ()),
        api_key=args.api_key or environ.get(API_KEY_ENV) or None,
        max_queue_len=args.max_queue_len, max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout, disable_log_stats=args.disable_log_stats,
        request_body_timeout=args.request_body_timeout,
        disable_log_requests=args.disable_log_requests,
        enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
        memory_monitor=environ.get(MEMORY_MONITOR_ENV, "0") not in ("", "0", "false"),
        keep_alive_on_engine_death=environ.get(KEEP_ALIVE_ENV, "0") not in ("", "0", "false"),
        engine_process=environ.get(MULTIPROCESSING_ENV, "1") not in ("", "0", "false"),
        api_server_count=args.api_server_count, data_parallel_size=args.data_parallel_size,
        memory_monitor_interval=float(environ.get(MEMORY_MONITOR_INTERVAL_ENV, "10")),
        chat_template=read_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        pooler_config=args.pooler_config or PoolingParams(),
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        headless=args.headless)
    gpus = visible_gpus(environ)  # known before loading on CUDA only (None elsewhere)
    needed = (server.data_parallel_size * engine.tensor_parallel_size
              * engine.pipeline_parallel_size) // engine.nnodes  # this node's share
    if gpus is not None and needed > len(gpus):
        raise ValueError(f"--data-parallel-size={server.data_parallel_size} x "
                         f"--tensor-parallel-size={engine.tensor_parallel_size} x "
                         f"--pipeline-parallel-size={engine.pipeline_parallel_size} needs "
                         f"{needed} GPUs but {len(gpus)} are visible")
    return engine, server


def parse_pooler_config(text: str) -> PoolingParams:
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("it must be a JSON object")
        unknown = set(value) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} (known: pooling_type, normalize)")
        return PoolingParams(**value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--pooler-config: {e}") from None


def bundled_chat_templates() -> list[str]:
    return sorted(name.removesuffix(".jinja") for name in os.listdir(CHAT_TEMPLATES))


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a bundled template's name, a file, or the template text (vLLM takes a
    file or the text)."""
    if value is None:
        return None
    bundled = os.path.join(CHAT_TEMPLATES, value + ".jinja")
    for path in (bundled, value):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    if "{" in value:  # the template itself
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a template; bundled "
                     f"templates: {', '.join(bundled_chat_templates())}")
