"""The schema and the interactive docs are served, and the docs need no CDN."""

import re


def test_the_openapi_schema_describes_the_api_and_its_auth(client, db):
    response = client.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.")
    assert "/api/v1/authorize" in schema["paths"]
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    authorize = schema["paths"]["/api/v1/authorize"]["post"]
    assert {"200", "400", "401", "503"} <= set(authorize["responses"])
    # Break-glass open answers 409 (one live for the agent and tool, or one unreviewed)
    # and 429 (the opener's hourly limit): both documented.
    breakglass = schema["paths"]["/api/v1/breakglass"]["post"]
    assert {"201", "403", "409", "429"} <= set(breakglass["responses"])
    assert "breakglass_unreviewed" in breakglass["description"]
    # Resume sits beside suspend, with its reason required and its 409s named.
    suspend = schema["paths"]["/api/v1/agents/{name}/suspend"]["post"]
    resume = schema["paths"]["/api/v1/agents/{name}/resume"]["post"]
    assert resume["operationId"] == "agent_resume"
    assert {"200", "400", "401", "403", "404", "409"} <= set(resume["responses"])
    assert resume["requestBody"] == suspend["requestBody"]
    assert resume["requestBody"]["required"] is True
    for code in ("agent_not_suspended", "parent_suspended", "resume_before_suspension"):
        assert code in resume["responses"]["409"]["description"]
    # A suspended agent gets no token: that 409 is documented too.
    issue = schema["paths"]["/api/v1/agents/{name}/tokens"]["post"]
    assert {"201", "409"} <= set(issue["responses"])
    assert "agent_suspended" in issue["description"]


def test_the_schema_says_an_approval_or_a_review_may_switch_delegation_off(client, db):
    """The approve body takes `delegable` (the deny body does not); a review's narrow too."""
    schema = client.get("/api/v1/schema/?format=json").json()

    def body(path: str) -> dict:
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        return schema["components"]["schemas"][ref["schema"]["$ref"].rsplit("/", 1)[1]]

    approve = body("/api/v1/grant-requests/{grant_id}/approve")
    assert approve["properties"]["delegable"]["type"] == "boolean"
    assert "delegable" not in approve.get("required", [])
    assert "invalid_narrowing" in approve["properties"]["delegable"]["description"]
    assert "delegable" not in body("/api/v1/grant-requests/{grant_id}/deny")["properties"]
    review = body("/api/v1/reviews/items/{item_id}/decide")
    assert review["properties"]["delegable"]["type"] == "boolean"
    assert "wider_delegation" in review["properties"]["delegable"]["description"]


def test_the_docs_page_loads_its_assets_from_this_server(client, db):
    response = client.get("/api/v1/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources, "the page references its assets"
    assert all(not s.startswith(("http://", "https://", "//")) for s in sources), sources


def test_the_schema_and_docs_are_public_whatever_credentials_come_with_the_request(client, db):
    """Credentials are not read there: a runner whose token just expired (or any bad
    header) gets the same schema and page as a caller without one, not a 401 rendered
    as YAML or HTML."""
    for path in ("/api/v1/schema/", "/api/v1/schema/?format=json", "/api/v1/docs/"):
        anonymous = client.get(path)
        assert anonymous.status_code == 200
        for header in ("Bearer nope", "Bearer agt_00000000_" + "x" * 40, "Basic Zm9vOmJhcg=="):
            answer = client.get(path, HTTP_AUTHORIZATION=header)
            assert answer.status_code == 200, (path, header, answer.content[:200])
            if "schema" in path:  # the docs page carries a fresh nonce each time
                assert answer.content == anonymous.content
            else:
                assert b"swagger-ui" in answer.content
