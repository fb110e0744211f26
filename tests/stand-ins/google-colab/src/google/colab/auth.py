"""Stand-in for ``google.colab.auth``: makes Application Default Credentials available.

Like Colab's, ``authenticate_user()`` writes the user's credentials to a file and points
``GOOGLE_APPLICATION_CREDENTIALS`` at it, so that ``google.auth.default()`` (and through it
``googleapiclient.discovery.build``) finds them. The file holds an ``authorized_user``
credential with an access token that the simulated Google accepts and that does not expire
for a year, so the real google-auth library never needs to refresh it (a refresh would go to
Google's real token endpoint, which google-auth hard-codes for this credential type).
"""

from __future__ import annotations

import json as _json
import os as _os
import tempfile as _tempfile
from datetime import datetime as _datetime
from datetime import timedelta as _timedelta
from datetime import timezone as _timezone

import colab_standin as _standin

__all__ = ["authenticate_user"]


def authenticate_user(clear_output: bool = True) -> None:
    """Ensures that the given user is authenticated."""
    current = _os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
    if current and _os.path.exists(current):
        return
    _standin.api_url()  # Google's side must be up before anything asks it
    expiry = _datetime.now(_timezone.utc) + _timedelta(days=365)
    # Beside the simulated cloud's folder (a test's own), never in the machine's /tmp: a test
    # leaves no credential file behind, even from a kernel that was killed.
    cloud_root = _os.path.abspath(_os.environ[_standin.ROOT_ENV])
    folder = _tempfile.mkdtemp(prefix="colab-standin-adc-", dir=_os.path.dirname(cloud_root))
    path = _os.path.join(folder, "adc.json")
    with open(path, "w") as handle:
        _json.dump(
            {
                "type": "authorized_user",
                "client_id": "standin.apps.googleusercontent.com",
                "client_secret": "standin-secret",
                "refresh_token": "standin-refresh-token",
                "token": _standin.access_token(),
                "expiry": expiry.strftime("%Y-%m-%dT%H:%M:%SZ"),
            },
            handle,
        )
    _os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = path
