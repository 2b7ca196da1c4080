"""mkdocs hooks: pages generated from the code, so that the docs cannot drift.

``docs/configuration.md``'s ``<!-- qarray-settings-table -->`` becomes the table
of environment variables from ``qarray.tesseract.Settings``.
"""

MARKER = "<!-- qarray-settings-table -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    from qarray.tesseract import Settings

    return markdown.replace(MARKER, Settings.markdown_table())
