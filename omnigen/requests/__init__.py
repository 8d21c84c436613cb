"""Request builders: a user's request (text and the model's own options) to the first stage's
prompt and payload, one builder per model, declared in the model's config (``request_builder``)."""
