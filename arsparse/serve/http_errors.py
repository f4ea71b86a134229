"""uvicorn's answer to a request it cannot parse, in JSON like every other error of the API.

A bad request line, a malformed header or a Content-Length that is not a number never reaches the
app: uvicorn's HTTP/1.1 protocol answers it itself with a plain-text 400 that says only "Invalid HTTP
request received.". :class:`JsonErrorH11Protocol` is that protocol with the answer as
``{"detail": ...}`` naming what h11 found wrong; ``uvicorn.run(app, http=JsonErrorH11Protocol)``.
"""
from __future__ import annotations

import json
import sys

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_ALLOWED = "this server answers HTTP/1.1 requests such as POST /v1/generate with a JSON body"


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this inside its ``except h11.RemoteProtocolError``: the error says what was wrong."""
        err = sys.exc_info()[1]
        why = str(err) if isinstance(err, h11.RemoteProtocolError) and str(err) else msg.rstrip(".")
        why = why if len(why) <= 200 else why[:200] + "..."  # (h11 quotes the offending line: up to 16 KB)
        body = json.dumps({"detail": f"malformed HTTP request ({why}); {_ALLOWED}"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
