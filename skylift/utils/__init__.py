"""Small helpers shared by unrelated parts of skylift."""
