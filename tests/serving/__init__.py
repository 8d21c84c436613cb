"""Serving tests (issue 8): the transport between stages."""
