"""After fusing: the original and the fused graph on ORT CPU over cases that take every branch
a chosen form has (``verify``), what is said when they differ (``mismatch``), a mixture of
experts' routes held to the original's meanwhile (``routes``)."""
