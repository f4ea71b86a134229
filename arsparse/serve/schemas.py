"""Request and response models of the HTTP API (pydantic), so the OpenAPI schema states every limit."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from ..models.config import GPTConfig

PolicyArg = Union[bool, int, float, str, None]


def _integral(v):
    """JSON Schema counts 3.0 as an integer: take it as 3 (3.5, "3" and true stay invalid)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]


def generate_request_model(cfg: GPTConfig, max_images: int, max_timeout_s: float, policies: list[str],
                           cfg_scale_default: float, policy_cfg_scales: dict[str, float] | None = None) -> type[BaseModel]:
    """The body of ``POST /v1/generate`` for this model and server: ranges from the model's config.

    Strict types (no "3" for 3, no true for 1), unknown fields rejected, no NaN or infinity.
    """
    fields: dict[str, Any] = {}
    if cfg.model_type == "c2i":
        fields["class_label"] = (Int, Field(ge=0, le=cfg.num_classes - 1, description=(
            f"class to draw, 0..{cfg.num_classes - 1}")))
    else:
        row = Annotated[list[float], Field(min_length=cfg.caption_dim, max_length=cfg.caption_dim)]
        fields["caption_features"] = (list[row], Field(min_length=1, max_length=cfg.cls_token_num, description=(
            f"T5 features of the caption's real tokens, 1..{cfg.cls_token_num} rows of {cfg.caption_dim}; fewer "
            f"than {cfg.cls_token_num} are left-padded and masked as LlamaGen's sampler does")))
    guidance = cfg.model_type == "t2i" or cfg.has_null_class
    fields.update(
        n=(Int, Field(1, ge=1, le=max_images, description="images to draw (all of the same condition)")),
        # (below 2**53: the integers JSON numbers carry exactly, in every client and in the schema's own
        # bound; 2**63 as a bound rounded in schema-driven clients, which then sent it as valid)
        seed=(Annotated[Optional[Annotated[int, Field(ge=0, lt=2**53)]], BeforeValidator(_integral)], Field(None, description=(
            "image i uses the noise key (seed, i), as Generator.sample_tokens(seed=seed); 0 <= seed < 2**53; "
            "random when omitted"))),
        cfg_scale=(Optional[float], Field(None, ge=0.0, le=100.0 if guidance else 1.0, description=(
            f"classifier-free guidance, 1 = off (default {cfg_scale_default}"
            + "".join(f"; {p} at its default settings: {g:g}" for p, g in (policy_cfg_scales or {}).items()) + ")"
            + ("" if guidance else "; this model has no null class, so only 1")))),
        temperature=(float, Field(1.0, ge=0.0, le=100.0, description="0 = greedy")),
        top_k=(Int, Field(0, ge=0, le=cfg.vocab_size, description="0 = off, 1 = greedy")),
        top_p=(float, Field(1.0, gt=0.0, le=1.0, description="1 = off")),
        cfg_interval=(Int, Field(-1, ge=-1, le=cfg.image_tokens, description=(
            "guide only the first cfg_interval + 2 tokens (LlamaGen's); -1 = all"))),
        policy=(Optional[Literal[tuple(policies)]], Field(None, description=(
            "sparse-attention policy (GET /v1/policies); default: the server's"))),
        policy_args=(Optional[dict[str, PolicyArg]], Field(None, max_length=16, description=(
            "policy parameters, e.g. {\"rows\": 2}; default: the policy's defaults (the server's own "
            "arguments when policy is omitted or names the server's policy)"))),
        timeout_s=(Optional[float], Field(None, gt=0.0, le=max_timeout_s, description=(
            "give up after this many seconds (504); default: the server's"))),
        return_tokens=(bool, Field(False, description="also return the image tokens")),
    )
    return create_model("GenerateRequest", __config__=ConfigDict(extra="forbid", strict=True, allow_inf_nan=False),
                        **fields)


class Timing(BaseModel):
    queue_s: float = Field(description="waiting for free slots")
    generate_s: float = Field(description="prefill, decoding and image decoding")
    total_s: float = Field(description="from arrival to answer, as the server saw it")


class PolicyRef(BaseModel):
    name: str
    label: str = Field(description="name and the parameters that differ from the defaults")
    mode: Literal["continuous", "cohort"] = Field(description="how requests are batched under this policy")


class GenerateResponse(BaseModel):
    id: str
    model: str
    policy: PolicyRef
    seed: int
    n: int
    width: int
    height: int
    images: list[str] = Field(description="base64 PNGs, one per image")
    tokens: Optional[list[list[int]]] = Field(None, description="image tokens, when return_tokens was set")
    timing: Timing


class ErrorItem(BaseModel):
    field: str
    message: str


class ErrorResponse(BaseModel):
    detail: str = Field(description="what was wrong and what is allowed")
    errors: Optional[list[ErrorItem]] = None


class ModelInfo(BaseModel):
    name: str
    model_type: Literal["c2i", "t2i"]
    num_classes: Optional[int]
    class_names: Optional[list[str]]
    caption_shape: Optional[list[int]]
    image_tokens: int
    grid: list[int]
    width: int
    height: int
    cfg_scale: float
    guidance: bool
    policy_cfg_scales: Optional[dict[str, float]] = Field(None, description=(
        "guidance calibrated for these policies at their default settings, which their requests get by default"))
    max_images: int
    parameters: int


class ModelsResponse(BaseModel):
    models: list[ModelInfo]


class PolicyInfo(BaseModel):
    name: str
    kind: str
    mode: Literal["continuous", "cohort"]
    source: str
    doc: str
    params: dict[str, Any]


class PoliciesResponse(BaseModel):
    default: str = Field(description="the server's policy (used when a request names none)")
    default_params: dict[str, Any]
    live: list[str] = Field(description="policies with a slot pool now")
    policies: list[PolicyInfo]


class HealthResponse(BaseModel):
    status: Literal["ok"]
    model: str
    policies: list[dict[str, Any]] = Field(description="per live policy: slots, queue, running images, ...")
