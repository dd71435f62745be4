"""The parts of bench/protocol_attacks.py: clients.py (the authorised client and the overload's load), floods.py
(HTTP/2 frames as fast as the socket takes them), slow.py (the attacks on time limits), run.py (one attack against a
fresh server and proxy, measured), report.py (what became of each, and the markdown rows)."""

TOKEN = "protocol-attack-token-0123456789"
AUTH = [("authorization", f"Bearer {TOKEN}")]
CLASSIFY = "/sentiment.v1.SentimentService/Classify"
ATTACKER = "127.0.0.2"
