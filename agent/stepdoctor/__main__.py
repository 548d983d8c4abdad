from stepdoctor.cli import entry

entry()
