"""Only what pyproject.toml cannot say: install ``infinikv_lm_eval.pth`` beside the package (in a
wheel and in an editable install), so that ``lm_eval --model infinikv`` finds infinikv's model."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path("src", "infinikv_lm_eval.pth")


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib, PTH.name)), preserve_mode=False)


class EditableWithPth(editable_wheel):
    def _create_wheel_file(self, bdist_wheel):
        from wheel.wheelfile import WheelFile

        wheel_path = super()._create_wheel_file(bdist_wheel)
        with WheelFile(wheel_path, "a") as wheel:
            wheel.write(str(PTH), PTH.name)
        return wheel_path


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
