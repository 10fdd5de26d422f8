"""Header names the server and the router both read."""

# an agent's label for stats and placement (else the body's ``user``); a router places the
# requests of one agent together, a replica counts hits per agent
AGENT_HEADER = "X-Agent-Id"
