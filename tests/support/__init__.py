"""Helpers shared by the tests (servers, scripted apps, fixtures' machinery); no tests live here."""
