"""Online acceptance estimator for adaptive verification (docs/design/specs/adaptive_verification.md).

A logistic model ``P(draft k accepted | chain reached k) = sigmoid(omega * f + beta_k)`` over the feature
``f = logit(q_max)`` of the draft distribution, fitted online by IRLS (Newton on the log-loss) from
accumulated O(K) statistics. No confidence head is needed; the feature never reads the sampled token, so
pruning on it keeps verification exact.
"""

from .config import EstimatorConfig
from .estimator import AcceptanceEstimator
from .features import draft_confidence_feature
from .irls import irls_accumulate, irls_accumulate_reference, irls_labels, irls_solve

__all__ = [
    "AcceptanceEstimator",
    "EstimatorConfig",
    "draft_confidence_feature",
    "irls_accumulate",
    "irls_accumulate_reference",
    "irls_labels",
    "irls_solve",
]
