"""The live dashboard: one local web page that shows a run as it goes.

``view`` turns what the coordinator and the run's DHT say into the page's JSON (small pure functions), ``feed``
follows the coordinator (read-only, reconnecting) and keeps the latest view, ``app`` serves the page and the JSON
with starlette. The page itself (``static/``) is plain HTML, CSS and JavaScript with no build step; it writes
every value peers chose as text, never as markup.

May import: coordinator_program, client.stages, client.backends, client.swarm.
"""
