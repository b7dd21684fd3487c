"""Apply: carry a plan out against the cluster (the status first, then the children) and send
the requests the plan holds for the trainers."""
