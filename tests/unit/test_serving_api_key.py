"""serve(api_key=...): a request without the key as a bearer token gets vLLM's 401, every route but
/health; the replicas hold only the key's digest."""

import pytest

from baige_ray.serving.api_key import API_KEY_ENV, api_key_digest, is_authorized
from tests.unit.fixtures.openai_server import call, make_server, stop_server


def test_the_key_comes_from_the_argument_or_the_environment_and_an_empty_one_is_refused(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_digest(None) is None
    digest = api_key_digest("sk-local")
    assert digest != "sk-local" and len(digest) == 64
    monkeypatch.setenv(API_KEY_ENV, "sk-local")
    assert api_key_digest(None) == digest
    with pytest.raises(ValueError, match="api_key=...\\) is invalid: expected a non-empty string"):
        api_key_digest(" ")


def test_only_the_bearer_token_of_the_key_passes():
    digest = api_key_digest("sk-local")
    assert is_authorized("Bearer sk-local", digest) and is_authorized("bearer  sk-local ", digest)
    for header in (None, "", "Bearer", "Bearer sk-other", "Basic sk-local", "sk-local"):
        assert not is_authorized(header, digest), header


@pytest.fixture
def server():
    replica = make_server()
    replica._api_key_digest = api_key_digest("sk-local")
    yield replica
    stop_server(replica)


def test_a_replica_with_a_key_answers_401_without_it_and_serves_with_it(server):
    body = {"model": "m", "prompt": "ab", "max_tokens": 2}
    for path, payload in (("v1/completions", body), ("v1/models", None), ("generate", {"prompt": "ab"}),
                          ("tokenize", {"prompt": "ab"}), ("v1/nowhere", None)):
        assert call(server, path, payload) == (401, {"error": "Unauthorized"}), path
        assert call(server, path, payload, headers={"Authorization": "Bearer sk-other"})[0] == 401, path
    status, answer = call(server, "v1/completions", body, headers={"Authorization": "Bearer sk-local"})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    assert call(server, "health")[0] == 200  # probes need no key
