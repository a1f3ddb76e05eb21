"""The dashboard: its JSON views, the auth service's contributor map, and the page in a real browser."""
