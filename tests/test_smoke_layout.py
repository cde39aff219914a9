from governance.audit import verify_chain


def test_a_fresh_database_verifies_as_an_empty_chain(db):
    verdict = verify_chain()
    assert verdict.ok and verdict.count == 0
    assert verdict.render().startswith("ok: 0 events")
