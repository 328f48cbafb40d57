"""What travels between a gateway and the replicas it launched, besides the OpenAI API itself: the names (and
the one range) both sides must agree on, in one place."""

# On a replica's error reply: "request" when the error is that request's own (an engine fault it alone caused, or
# a bug its handling ran into), so the gateway neither retries it elsewhere nor holds it against the replica.
ERROR_SCOPE_HEADER = "x-multiserve-error-scope"

# On a replica's streamed reply: the prompt's size in tokens, so a gateway can charge a stream that carries no
# usage chunk (per-key token limits, the traffic log).
PROMPT_TOKENS_HEADER = "x-multiserve-prompt-tokens"

# A request's `priority` that a replica accepts: 32 bits, as vLLM's. The gateway reads a lane only from one in this
# range and leaves any other to the replica's 400 (runtimes/server/protocol.py), so both must agree on it.
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1

# In a launched worker's environment: the token every request to it must carry (foundation/http/replica_auth.py).
REPLICA_TOKEN_ENV = "MULTISERVE_REPLICA_TOKEN"

# On a generation the gateway may have to continue elsewhere: asks the replica to put, before each streamed event
# that carries tokens, an SSE comment line `: multiserve-tokens 12,345` with their ids. Clients ignore comment lines;
# the gateway strips them anyway, and keeps the ids to resume the stream on another replica if this one fails.
RESUMABLE_HEADER = "x-multiserve-resumable"
TOKENS_COMMENT = ": multiserve-tokens "

# A non-streamed generation asked for with RESUMABLE_HEADER is answered, once its first token is out, as progress
# (media type PROGRESS_MEDIA_TYPE): a TOKENS_COMMENT line for each output that carries tokens, then a line
# REPLY_LINE + "<status>" and, as the rest of the body, the reply (JSON) the client is to get with that status. If
# the replica fails before that line, the gateway continues the request elsewhere, and only the final reply, from
# whichever replica finished it, reaches the client.
PROGRESS_MEDIA_TYPE = "application/x-multiserve-progress"
REPLY_LINE = ": multiserve-reply "

# In the body of a continuation (runtimes/server/protocol.py ResumeFields): the tokens already generated, and (for a
# stream) the id and creation time the continued stream keeps.
RESUME_FIELD = "multiserve_resume"
