"""``memsave plan``: the estimator, a cost model and a search, to choose a configuration before the first run.

- :mod:`memsave.plan.formulas`: the published closed forms (ZeRO model states, Korthikanti et al.'s activation
  bytes per layer, Narayanan et al.'s FLOPs);
- :mod:`memsave.plan.spec`: a model's shape (:class:`ModelSpec`) from the reference GPT, a Hugging Face
  ``config.json`` or any module;
- :mod:`memsave.plan.hardware`: rates, measured by ``memsave calibrate`` or from vendor data sheets;
- :mod:`memsave.plan.cost`: one configuration priced, bytes by category and seconds by term;
- :mod:`memsave.plan.search`: every configuration, ranked, with the reasons for the rejected;
- :mod:`memsave.plan.profile`: a configuration as a profile, and its exact memory by :func:`memsave.estimate`.
"""

from memsave.plan.cost import Candidate, Priced, price
from memsave.plan.formulas import LayerActivations, gpt_step_flops, layer_activation_bytes, zero_model_states
from memsave.plan.hardware import VENDOR, Hardware, calibrate, load_hardware
from memsave.plan.profile import exact_peak, to_profile, to_toml
from memsave.plan.search import Plan, PlanError, candidates, plan
from memsave.plan.spec import ModelSpec, from_gpt, from_hf_config, from_module

__all__ = ["VENDOR", "Candidate", "Hardware", "LayerActivations", "ModelSpec", "Plan", "PlanError", "Priced",
           "calibrate", "candidates", "exact_peak", "from_gpt", "from_hf_config", "from_module", "gpt_step_flops",
           "layer_activation_bytes", "load_hardware", "plan", "price", "to_profile", "to_toml",
           "zero_model_states"]
