"""On the GPU: what the default JAXLLM_INT4_HOPPER resolves to for the 8B AWQ dummy model."""
import logging
import time

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import jax  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm import attention  # noqa: E402
from jaxllm.engine.int4_layout import with_int4_layout  # noqa: E402
from jaxllm.engine.kv_sizing import model_device, total_device_memory  # noqa: E402
from jaxllm.layers.linear import int4_hopper_mode  # noqa: E402

t = time.perf_counter()
model = jaxllm.load_model("llama-3-8b", load_format="dummy", quantization="awq",
                          unroll_layers=True)
print("mode", int4_hopper_mode(), "capability", attention.device_compute_capability(),
      "memory", total_device_memory(model_device(model)), "loaded", time.perf_counter() - t)
t = time.perf_counter()
model = with_int4_layout(model, int4_hopper_mode(), donate=True)
jax.block_until_ready(model.params)
kernel = model.params["layers"][0]["mlp"]["down_proj"]["kernel"]
print("layout", type(kernel).__name__, type(getattr(kernel, "n_major", None)).__name__,
      "made in", round(time.perf_counter() - t, 2), "s")
