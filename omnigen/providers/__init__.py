"""Model providers: packages whose model classes omnigen serves (each one's import rules)."""
