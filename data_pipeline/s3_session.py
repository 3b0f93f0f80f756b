"""aiobotocore's HTTP session with aiohttp's own retry turned off (``storage.configure`` uses it).

aiohttp sends an idempotent request (GET, HEAD, PUT, DELETE) a second time by itself when the
connection is reset or closed before the answer's headers arrive (``ClientSession._retry_connection``,
on by default and not a constructor argument). Nothing above it sees that try: through the tests'
fault proxy it absorbed every reset connection and most answers cut short, so ``storage.retrying``
neither counted them (``data/read_retries``, ``ckpt/retries``) nor bounded them (a call could be
tried twice as often as its documented attempts). With this session a failed request reaches
``retrying`` as an error, so that there is one retry budget. aiohttp's own test client turns the
retry off the same way. Imported only where s3fs (and so aiobotocore) is installed.
"""

from __future__ import annotations

from typing import Any

from aiobotocore.httpsession import AIOHTTPSession


class OneAttemptAIOHTTPSession(AIOHTTPSession):
    """``AIOHTTPSession`` whose aiohttp sessions send each request once (botocore's ``http_session_cls``)."""

    async def _get_session(self, proxy_url: str | None) -> Any:
        session = await super()._get_session(proxy_url)
        session._retry_connection = False
        return session
