"""Contract double of NxDI models/model_wrapper.py (@ ef2731e): the submodel tags (mw.py L37-42), which name the
compiler work dir's subfolders (<work dir>/<tag>/_tp0_bk<i>/)."""

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
SPECULATION_MODEL_TAG = "speculation_model"
MEDUSA_MODEL_TAG = "medusa_speculation_model"
FUSED_SPECULATION_MODEL_TAG = "fused_speculation_model"
VISION_ENCODER_MODEL_TAG = "vision_encoder_model"
