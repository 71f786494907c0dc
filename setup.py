"""Only what pyproject.toml cannot say: install ``infinikv_lm_eval.pth`` beside the package (in a
wheel and in an editable install), so that ``lm_eval --model infinikv`` finds infinikv's model.
The file's one line imports the hook ``src/_infinikv_lm_eval.py``; it is written here, not kept
in the repository."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME, PTH_LINE = "infinikv_lm_eval.pth", "import _infinikv_lm_eval\n"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        Path(self.build_lib, PTH_NAME).write_text(PTH_LINE)


class EditableWithPth(editable_wheel):
    def _create_wheel_file(self, bdist_wheel):
        from wheel.wheelfile import WheelFile

        wheel_path = super()._create_wheel_file(bdist_wheel)
        with WheelFile(wheel_path, "a") as wheel:
            wheel.writestr(PTH_NAME, PTH_LINE)
        return wheel_path


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
