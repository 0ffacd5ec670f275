"""What goes over the wire: request and response bodies (`schemas`, `schemas_agent`), engine outputs as OpenAI
objects, server-sent events, and the error answers each route documents."""
