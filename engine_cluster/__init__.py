"""Scale-out: torch-engine replicas on Ray Serve (``replica``, ``app``), their autoscaling policy
(``policy``) and the gateway's view of them (``pool``: membership, prefix-affine routing,
retries). Only ``replica`` and ``app`` import Ray; the gateway imports Ray only when
``[cluster] enabled = true``."""
