"""OpenRLHF needs no client code: point its remote reward at the server's ``/get_reward``.

    --reward.remote_url http://127.0.0.1:8000/get_reward

with the dataset's label column holding each prompt's sample JSON without ``response``. OpenRLHF
posts ``{"query", "prompts", "labels"}`` and reads ``rewards`` (training), ``scores`` and
``extra_logs`` (logged); with several reward servers it sends empty lists to the others, which
answer empty lists.
"""

REMOTE_URL_FLAG = "--reward.remote_url"


def remote_url_flag(host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """The OpenRLHF arguments for a judge server at host:port."""
    return [REMOTE_URL_FLAG, f"http://{host}:{port}/get_reward"]
