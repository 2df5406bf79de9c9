"""Obviously-correct executable reference models of embcache (not installed; tests import them)."""
