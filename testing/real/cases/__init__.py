"""One module per real model stage: how to build its tiny checkpoint and what to send it."""
