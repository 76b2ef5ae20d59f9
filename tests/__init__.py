"""The test suite: folders mirror tidejax/ (and bench/, tools/); shared helpers live in tests.support."""
